"""The request mix of bench/soak.py: prompts, sampling settings, disconnects and bad requests.

Every choice is drawn from one `random.Random(--seed)`, so a run can be repeated. Prompts
come from a small pool and keep their max_tokens, and seeds from a short list, so the same
greedy or seeded request recurs and `Determinism` has answers to compare.

With --prefix-fraction, that share of the good requests is prefix-cache traffic
(`SharedPrefixes`): a new question after one of a few long system prompts (pool prompts joined),
an earlier such prompt sent again whole, or a chat's next turn (an earlier prompt and one more
question). A prompt sent again keeps its id, so its greedy and seeded answers, read from the
cache, are compared with the first.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from bench import serving
from bench.soak_checks import Plan

ENDPOINTS = ("completions", "chat", "generate")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
SHORT_PROMPTS = ("def fibonacci(n):\n", "import os\n", "class Stack:\n", "# read a file line by line\n",
                 "for i in range(", "The quick brown fox")
STOP_STRINGS = ("\n\n", "return", ")", ":\n", "def ")
SEEDS = (1, 2, 3)
REPEAT_SHARE = 0.3          # good requests that send a recent greedy or seeded recipe again
RECIPES_KEPT = 32
# Shares of the good requests (the rest: plain, one choice, no stops, no logprobs, stop at EOS).
STREAM_SHARE, N_SHARE, STOP_SHARE, LOGPROBS_SHARE, IGNORE_EOS_SHARE, USAGE_SHARE = 0.5, 0.15, 0.25, 0.3, 0.3, 0.8
SAMPLING_MODES = {          # name: (weight, fields); "seeded" also gets a seed from SEEDS
    "greedy": (4.0, {"temperature": 0.0}),
    "temperature": (1.5, {"temperature": 0.8}),
    "top_p": (1.5, {"temperature": 1.0, "top_p": 0.9, "top_k": 40}),
    "seeded": (3.0, {"temperature": 0.7, "top_p": 0.95}),
}


# Prefix-cache traffic: the system prompts, and the shares of prefix requests that send an earlier
# prompt again or continue one (the rest ask a new question after a system prompt).
SYSTEM_PROMPTS, SYSTEM_PARTS = 4, 4     # system prompts, each this many pool prompts joined
RESEND_SHARE, NEXT_TURN_SHARE = 0.3, 0.3
MAX_TURNS = 2                           # next turns of one conversation: prompts stay within the context
PREFIX_PROMPTS_KEPT = 64                # recent prefix prompts, to send again or continue


@dataclass(frozen=True)
class Prompt:
    id: int
    text: str
    max_tokens: int
    turn: int = 0                       # prefix prompts: the turns before this one in its conversation


class SharedPrefixes:
    """Prompts that start with one of a few long system prompts, drawn from `rng` (see the module's doc)."""

    def __init__(self, rng: random.Random, pool: list[Prompt]):
        self.rng, self.pool = rng, pool
        parts = pool[len(SHORT_PROMPTS):] or pool        # the dataset's prompts, where there are any
        self.systems = ["\n".join(rng.choice(parts).text for _ in range(SYSTEM_PARTS)) for _ in range(SYSTEM_PROMPTS)]
        self.sent: list[Prompt] = []
        self.next_id = max(p.id for p in pool) + 1

    def prompt(self) -> Prompt:
        rng, share = self.rng, self.rng.random()
        if self.sent and share < RESEND_SHARE:
            return rng.choice(self.sent)
        question = rng.choice(self.pool)
        earlier = rng.choice(self.sent) if self.sent and share < RESEND_SHARE + NEXT_TURN_SHARE else None
        if earlier is not None and earlier.turn < MAX_TURNS:
            return self.new(earlier.text + "\n" + question.text, question.max_tokens, earlier.turn + 1)
        return self.new(rng.choice(self.systems) + "\n" + question.text, question.max_tokens, 0)

    def new(self, text: str, max_tokens: int, turn: int) -> Prompt:
        prompt = Prompt(self.next_id, text, max_tokens, turn)
        self.next_id += 1
        self.sent = [*self.sent[-(PREFIX_PROMPTS_KEPT - 1):], prompt]
        return prompt


def prompt_pool(args) -> list[Prompt]:
    """The short fixed prompts, and unless --no-dataset the dataset's prompts (bench/serving.py's)."""
    pool = [Prompt(i, text, 8 if i % 2 else 16) for i, text in enumerate(SHORT_PROMPTS)]
    if args.no_dataset:
        return pool
    requests = serving.build_requests(args, serving.load_tokenizer(args.tokenizer))
    return pool + [Prompt(len(pool) + i, r.prompt, r.output_len) for i, r in enumerate(requests)]


def with_sampling(endpoint: str, body: dict, **fields) -> dict:
    """Sampling fields go into `sampling_params` on /generate, at the top level elsewhere."""
    if "max_tokens" in fields and endpoint == "generate":
        fields["max_new_tokens"] = fields.pop("max_tokens")
    (body["sampling_params"] if endpoint == "generate" else body).update(fields)
    return body


def base_body(endpoint: str, model: str | None, text: str, stream: bool) -> dict:
    if endpoint == "generate":
        return {"text": text, "sampling_params": {}, "stream": stream}
    body = {"model": model, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def ask_logprobs(endpoint: str, body: dict, rng: random.Random) -> None:
    if endpoint == "generate":
        body.update(return_logprob=True, top_logprobs_num=rng.choice((0, 2)))
    elif endpoint == "chat":
        body.update(logprobs=True, top_logprobs=rng.choice((0, 2)))
    else:
        body["logprobs"] = rng.choice((0, 1, 3))


@dataclass(frozen=True)
class Recipe:
    """What decides a request's text; greedy and seeded recipes must always give the same text."""
    prompt: Prompt
    endpoint: str
    mode: str                           # a key of SAMPLING_MODES
    seed: int | None
    stops: tuple[str, ...]
    ignore_eos: bool

    @property
    def determinism_key(self) -> tuple | None:
        if self.mode not in ("greedy", "seeded"):
            return None
        return self.mode, self.endpoint, self.prompt.id, self.prompt.max_tokens, self.stops, self.ignore_eos


class Mix:
    """Draws the plan of each request."""

    def __init__(self, args, pool: list[Prompt], model: str | None, context_length: int):
        self.rng = random.Random(args.seed)
        self.pool, self.model, self.context_length = pool, model, context_length
        self.bad_fraction, self.disconnect_fraction = args.bad_fraction, args.disconnect_fraction
        self.bad_kinds = args.bad_kinds
        self.recipes: list[Recipe] = []     # recent greedy and seeded ones, to send again
        self.prefix_fraction = args.prefix_fraction
        self.prefixes = SharedPrefixes(self.rng, pool) if args.prefix_fraction else None

    def plan(self, index: int) -> Plan:
        if self.rng.random() < self.bad_fraction:
            return self.bad_plan(index)
        return self.good_plan(index, disconnect=self.rng.random() < self.disconnect_fraction)

    def recipe(self) -> Recipe:
        """A recent greedy or seeded recipe again (REPEAT_SHARE), else a new one."""
        rng = self.rng
        if self.recipes and rng.random() < REPEAT_SHARE:
            return rng.choice(self.recipes)
        mode = rng.choices(list(SAMPLING_MODES), weights=[w for w, _ in SAMPLING_MODES.values()])[0]
        stops = tuple(rng.sample(STOP_STRINGS, rng.choice((1, 2)))) if rng.random() < STOP_SHARE else ()
        recipe = Recipe(self.draw_prompt(), rng.choice(ENDPOINTS), mode,
                        rng.choice(SEEDS) if mode == "seeded" else None, stops, rng.random() < IGNORE_EOS_SHARE)
        if recipe.determinism_key is not None:
            self.recipes = [*self.recipes[-(RECIPES_KEPT - 1):], recipe]
        return recipe

    def draw_prompt(self) -> Prompt:
        if self.prefixes is not None and self.rng.random() < self.prefix_fraction:
            return self.prefixes.prompt()
        return self.rng.choice(self.pool)

    def good_plan(self, index: int, disconnect: bool) -> Plan:
        """A recipe, sent in any shape: streamed or whole, n choices, with or without logprobs."""
        rng, recipe = self.rng, self.recipe()
        endpoint, max_tokens = recipe.endpoint, recipe.prompt.max_tokens
        stream = disconnect or rng.random() < STREAM_SHARE
        n = rng.choice((2, 3)) if rng.random() < N_SHARE else 1
        body = base_body(endpoint, self.model, recipe.prompt.text, stream)
        extra = ({"seed": recipe.seed} if recipe.seed is not None else {}) | \
                ({"stop": list(recipe.stops)} if recipe.stops else {})
        with_sampling(endpoint, body, max_tokens=max_tokens, n=n, ignore_eos=recipe.ignore_eos,
                      **SAMPLING_MODES[recipe.mode][1], **extra)
        logprobs = rng.random() < LOGPROBS_SHARE
        if logprobs:
            ask_logprobs(endpoint, body, rng)
        include_usage = stream and endpoint != "generate" and rng.random() < USAGE_SHARE
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        return Plan(index, endpoint, body, stream=stream, max_tokens=max_tokens, n=n, stops=recipe.stops,
                    logprobs=logprobs, include_usage=include_usage,
                    disconnect_after=rng.choice((1, 2)) if disconnect else 0,
                    determinism_key=recipe.determinism_key, seed=recipe.seed)

    def bad_plan(self, index: int) -> Plan:
        name = self.rng.choice(self.bad_kinds)
        endpoints, spoil = BAD_REQUESTS[name]
        endpoint = self.rng.choice(endpoints)
        body = with_sampling(endpoint, base_body(endpoint, self.model, "def f(x):\n", self.rng.random() < 0.5),
                             max_tokens=8)
        return Plan(index, endpoint, spoil(endpoint, body, self.context_length), stream=bool(body.get("stream")),
                    max_tokens=8, bad=name)


# ---- bad requests: each spoils a valid body in one way ---------------------------------

def empty_prompt(endpoint: str, body: dict, context_length: int) -> dict:
    key = {"completions": "prompt", "chat": "messages", "generate": "text"}[endpoint]
    body[key] = [] if endpoint == "chat" else ""
    return body


def out_of_vocab(endpoint: str, body: dict, context_length: int) -> dict:
    ids = [1, 2, 10**9]                 # beyond any vocabulary
    if endpoint == "generate":
        del body["text"]
        body["input_ids"] = ids
    else:
        body["prompt"] = ids
    return body


def spoil_sampling(**fields):
    return lambda endpoint, body, context_length: with_sampling(endpoint, body, **fields)


BAD_REQUESTS = {
    "invalid_json": (ENDPOINTS, lambda endpoint, body, context_length: json.dumps(body).encode()[:-1] + b",}"),
    "unsupported_parameter": (ENDPOINTS, spoil_sampling(presence_penalty=1)),
    "unknown_parameter": (ENDPOINTS, spoil_sampling(frobnicate=1)),
    "temperature_out_of_range": (ENDPOINTS, spoil_sampling(temperature=5)),
    "top_p_zero": (ENDPOINTS, spoil_sampling(top_p=0)),
    "n_too_large": (ENDPOINTS, spoil_sampling(n=100)),
    "empty_prompt": (ENDPOINTS, empty_prompt),
    "wrong_model": (("completions", "chat"), lambda endpoint, body, context_length: body | {"model": "no-such-model"}),
    "token_ids_out_of_vocab": (("completions", "generate"), out_of_vocab),
    "max_tokens_beyond_context": (ENDPOINTS, lambda endpoint, body, context_length:
                                  with_sampling(endpoint, body, max_tokens=context_length + 1)),
    "huge_stop_list": (ENDPOINTS, spoil_sampling(stop=[f"<stop {i}>" for i in range(1000)])),
}
