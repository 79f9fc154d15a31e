"""The checks of bench/soak.py: what one answer must look like, on plain data (no network).

`check_answer(plan, answer)` reads what the client got for one request (an HTTP status, a
body or the SSE payloads, a transport error or a timeout) and returns a `Verdict`: its
outcome and the violations found, each a (kind, detail) pair. `Determinism` compares the
texts of repeated greedy and seeded requests across the whole run.

Outcomes: ok; disconnected (the client closed a stream on purpose); rejected (a bad request
got its 4xx with an OpenAI error body); failed_clear (503, or a 500 / SSE error event that
says the engine failed or a rank died: allowed, counted apart); violation.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from bench.soak_grammar import grammar_problem

DONE = "[DONE]"
ERROR_KEYS = ("message", "type", "param", "code")
# A 500 or an error event is an allowed failure only when it says why: the engine or a rank.
CLEAR_ENGINE_ERROR = re.compile(r"engine|rank", re.IGNORECASE)


@dataclass
class Plan:
    """One request of the soak: where it goes, its body, and what its answer must satisfy."""
    index: int
    endpoint: str                       # completions | chat | generate
    body: dict | bytes                  # bytes go out as they are (a body that is not JSON)
    stream: bool = False
    max_tokens: int = 0
    n: int = 1
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    include_usage: bool = False         # OpenAI streams: a usage chunk must come
    disconnect_after: int = 0           # streams: close after this many events (0: read to the end)
    bad: str | None = None              # the kind of bad input this request carries
    determinism_key: tuple | None = None  # same key, same text (greedy; seeded with the seed added per choice)
    seed: int | None = None
    grammar: str | None = None          # structured outputs: what a stopped answer must match (soak_grammar.py)

    @property
    def kind(self) -> str:
        if self.bad:
            return f"bad/{self.bad}"
        return f"{self.endpoint}/{'stream' if self.stream else 'whole'}" + ("/grammar" if self.grammar else "")


@dataclass
class Answer:
    """What came back, as read off the wire."""
    status: int | None = None
    body: bytes = b""                   # the whole body of a non-streaming or failed request
    events: list[str] = field(default_factory=list)   # SSE `data:` payloads in order, [DONE] included
    error: str = ""                     # the connection failed (not a timeout)
    refused: bool = False               # it could not even connect
    timed_out: bool = False
    disconnected: bool = False          # the client closed the stream on purpose
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None


@dataclass
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    tokens: int | None = None           # tokens the answer shows one by one (logprob entries, output_ids)
    logprob_entries: int | None = None  # /generate: output_token_logprobs, next to output_ids
    completion_tokens: int | None = None  # /generate: the server's own count for this choice
    prompt_tokens: int | None = None


@dataclass
class Completion:
    """An answer's choices, whatever the endpoint, and its usage."""
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict | None = None
    duplicate_indexes: list[int] = field(default_factory=list)


@dataclass
class Verdict:
    outcome: str
    violations: list[tuple[str, str]] = field(default_factory=list)
    completion: Completion | None = None
    note: str = ""                      # failed_clear: the error the server gave


def check_answer(plan: Plan, answer: Answer) -> Verdict:
    if answer.timed_out:
        return Verdict("violation", [("timeout", f"no complete answer in time ({plan.kind})")])
    if answer.error and not answer.disconnected:
        return Verdict("violation", [("transport_error", answer.error)])
    if plan.bad:
        return check_refusal(plan, answer)
    if answer.status != 200:
        return check_failure(answer.status, parse_json(answer.body))
    if plan.stream:
        return check_stream(plan, answer)
    body = parse_json(answer.body)
    if body is None:
        return Verdict("violation", [("body_not_json", short(answer.body))])
    completion, problems = read_whole(plan, body)
    return finish_verdict(plan, completion, problems)


# ---- errors -------------------------------------------------------------------------

def parse_json(raw: bytes | str):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def short(value, limit: int = 160) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_body_problem(body) -> str | None:
    """What keeps `body` from being an OpenAI error `{"error": {message, type, param, code}}`."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an OpenAI error object: {short(json.dumps(body) if body is not None else 'no JSON')}"
    error = body["error"]
    missing = [key for key in ERROR_KEYS if key not in error]
    if missing:
        return f"error object lacks {missing}: {short(json.dumps(error))}"
    if not isinstance(error["message"], str) or not error["message"].strip():
        return f"error without a message: {short(json.dumps(error))}"
    return None


def is_clear_failure(status: int | None, error: dict) -> bool:
    """503 is always allowed (overload, restarting, shutting down); a 500 or an error event
    only when its message names the engine or a rank."""
    return status == 503 or bool(CLEAR_ENGINE_ERROR.search(error.get("message", "")))


def check_failure(status: int | None, body) -> Verdict:
    """A good request answered with an error status."""
    problem = error_body_problem(body)
    if problem is not None:
        return Verdict("violation", [("error_body_malformed", f"HTTP {status}: {problem}")])
    if status in (500, 503) and is_clear_failure(status, body["error"]):
        return Verdict("failed_clear", note=f"HTTP {status}: {short(body['error']['message'])}")
    return Verdict("violation", [("unexpected_status", f"HTTP {status}: {short(body['error']['message'])}")])


def check_refusal(plan: Plan, answer: Answer) -> Verdict:
    """A bad request must get a 4xx with an OpenAI error body (a 503 is allowed: overload)."""
    body = parse_json(answer.body) if not answer.events else None
    status = answer.status or 0
    if status == 200:
        return Verdict("violation", [("bad_request_accepted", f"{plan.bad} on {plan.endpoint} got 200")])
    problem = error_body_problem(body)
    if problem is not None:
        return Verdict("violation", [("error_body_malformed", f"{plan.bad}: HTTP {status}: {problem}")])
    if status == 503:
        return Verdict("failed_clear", note=f"HTTP 503: {short(body['error']['message'])}")
    if not 400 <= status < 500:
        return Verdict("violation", [("bad_request_not_4xx", f"{plan.bad} on {plan.endpoint} got HTTP {status}: "
                                                             f"{short(body['error']['message'])}")])
    return Verdict("rejected")


# ---- streams --------------------------------------------------------------------------

def stream_events(answer: Answer) -> tuple[list[dict], list[tuple[str, str]]]:
    """The parsed events, and what is wrong with the stream's framing."""
    problems = []
    payloads = answer.events
    if not answer.disconnected and (not payloads or payloads[-1] != DONE):
        last = short(payloads[-1], 80) if payloads else "none"
        problems.append(("stream_incomplete", f"{len(payloads)} events and no final [DONE] (last: {last})"))
    if DONE in payloads[:-1]:
        problems.append(("stream_after_done", f"events after [DONE]: {short(payloads[payloads.index(DONE) + 1])}"))
    events = []
    for payload in payloads:
        data = parse_json(payload) if payload != DONE else None
        if payload != DONE and not isinstance(data, dict):
            problems.append(("stream_bad_json", short(payload)))
        elif data is not None:
            events.append(data)
    return events, problems


def stream_error(events: list[dict], problems: list[tuple[str, str]]) -> Verdict | None:
    """The verdict on a stream with an error event (failed_clear when it says why), else None."""
    errors = [event for event in events if "error" in event]
    if not errors:
        return None
    problem = error_body_problem(errors[0])
    if problem is None and not is_clear_failure(None, errors[0]["error"]):
        problem = short(errors[0]["error"]["message"])
    if problem is not None:
        problems = problems + [("stream_error_event", problem)]
    note = f"error event: {short(errors[0]['error'].get('message'))}" if problem is None else ""
    return Verdict("violation" if problems else "failed_clear", problems, note=note)


def check_stream(plan: Plan, answer: Answer) -> Verdict:
    events, problems = stream_events(answer)
    failed = stream_error(events, problems)
    if failed is not None:
        return failed
    if answer.disconnected:
        return Verdict("violation" if problems else "disconnected", problems)
    completion, more = read_stream(plan, events)
    return finish_verdict(plan, completion, problems + more)


def finish_verdict(plan: Plan, completion: Completion, problems: list[tuple[str, str]]) -> Verdict:
    if any(choice.finish_reason == "abort" for choice in completion.choices.values()):    # the engine ended it
        return Verdict("violation" if problems else "failed_clear", problems, completion, "finish_reason abort")
    problems = problems + check_completion(plan, completion)
    return Verdict("violation" if problems else "ok", problems, completion)


# ---- reading choices ----------------------------------------------------------------

def read_whole(plan: Plan, body) -> tuple[Completion, list[tuple[str, str]]]:
    completion = Completion()
    if plan.endpoint == "generate":
        outputs = body if isinstance(body, list) else [body]
        problems = [p for output in outputs for p in read_generate_output(plan, output, completion, False)]
        return completion, problems
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return completion, [("body_malformed", f"no choices list: {short(json.dumps(body))}")]
    completion.usage = body.get("usage")
    problems = [p for raw in body["choices"] for p in read_openai_choice(plan, raw, completion, False)]
    return completion, problems


def read_stream(plan: Plan, events: list[dict]) -> tuple[Completion, list[tuple[str, str]]]:
    completion = Completion()
    problems = []
    for event in events:
        if plan.endpoint == "generate":
            problems += read_generate_output(plan, event, completion, True)
            continue
        if event.get("usage"):
            completion.usage = event["usage"]
        for raw in event.get("choices") or []:
            problems += read_openai_choice(plan, raw, completion, True)
    return completion, problems


def choice_at(completion: Completion, index, streamed: bool) -> Choice | None:
    """The choice with this index; a whole answer that repeats an index is noted."""
    if not isinstance(index, int):
        return None
    if index in completion.choices and not streamed:
        completion.duplicate_indexes.append(index)
    return completion.choices.setdefault(index, Choice(index))


def read_openai_choice(plan: Plan, raw: dict, completion: Completion, streamed: bool) -> list[tuple[str, str]]:
    """Add one choice (whole) or one chunk's piece of a choice (streamed)."""
    choice = choice_at(completion, raw.get("index") if isinstance(raw, dict) else None, streamed)
    if choice is None:
        return [("choices_wrong", f"a choice without an integer index: {short(json.dumps(raw))}")]
    if plan.endpoint == "chat":
        choice.text += (raw.get("message") or raw.get("delta") or {}).get("content") or ""
    else:
        choice.text += raw.get("text") or ""
    if raw.get("finish_reason") is not None:
        choice.finish_reason = raw["finish_reason"]
    if not plan.logprobs:
        return []
    count, problem = logprob_count(plan.endpoint, raw.get("logprobs"), streamed)
    choice.tokens = (choice.tokens or 0) + count
    return [("logprobs_wrong", f"choice {choice.index}: {problem}")] if problem else []


def logprob_count(endpoint: str, logprobs, streamed: bool) -> tuple[int, str | None]:
    """Tokens an OpenAI logprobs object lists, and what is wrong with it (its lists must agree)."""
    if logprobs is None:
        return 0, None if streamed else "logprobs asked for and missing"     # a chunk may carry none
    if endpoint == "chat":
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        return (len(content), None) if isinstance(content, list) else (0, f"no content list: {short(logprobs)}")
    lists = {key: logprobs.get(key) if isinstance(logprobs, dict) else None
             for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    if not all(isinstance(value, list) for value in lists.values()):
        return 0, f"missing lists: {short(logprobs)}"
    lengths = {key: len(value) for key, value in lists.items()}
    if len(set(lengths.values())) != 1:
        return lengths["tokens"], f"lists of different lengths {lengths}"
    return lengths["tokens"], None


def read_generate_output(plan: Plan, output, completion: Completion, streamed: bool) -> list[tuple[str, str]]:
    """One /generate output (streamed: cumulative text and output_ids so far)."""
    if not isinstance(output, dict) or not isinstance(output.get("meta_info"), dict):
        return [("body_malformed", f"not a /generate output: {short(json.dumps(output))}")]
    choice = choice_at(completion, output.get("index", 0), streamed)
    if choice is None:
        return [("choices_wrong", f"an output without an integer index: {short(output.get('index'))}")]
    problems = []
    text, meta = output.get("text") or "", output["meta_info"]
    if streamed and not text.startswith(choice.text):
        problems.append(("stream_not_cumulative", f"{short(choice.text, 60)!r} then {short(text, 60)!r}"))
    choice.text = text
    choice.tokens = len(output.get("output_ids") or [])
    choice.completion_tokens, choice.prompt_tokens = meta.get("completion_tokens"), meta.get("prompt_tokens")
    finish = meta.get("finish_reason")
    choice.finish_reason = finish.get("type") if isinstance(finish, dict) else finish
    if plan.logprobs:
        choice.logprob_entries = len(meta.get("output_token_logprobs") or [])
    return problems


# ---- what a complete answer must satisfy ------------------------------------------------

def check_completion(plan: Plan, completion: Completion) -> list[tuple[str, str]]:
    problems = check_choices(plan, completion)
    for choice in completion.choices.values():
        problems += check_choice(plan, choice, choice_count(plan, completion, choice))
    if plan.endpoint != "generate":
        problems += check_usage(plan, completion)
    return problems


def check_choices(plan: Plan, completion: Completion) -> list[tuple[str, str]]:
    indexes, repeated = sorted(completion.choices), completion.duplicate_indexes
    if indexes != list(range(plan.n)) or repeated:
        detail = f"n={plan.n} but choice indexes {indexes}"
        return [("choices_wrong", detail + (f", {repeated} repeated" if repeated else ""))]
    return []


def choice_count(plan: Plan, completion: Completion, choice: Choice) -> int | None:
    """The completion tokens of one choice, where the answer tells them apart."""
    if plan.endpoint == "generate":
        return choice.completion_tokens
    if plan.n == 1 and completion.usage:
        return completion.usage.get("completion_tokens")
    return choice.tokens


def check_choice(plan: Plan, choice: Choice, count: int | None) -> list[tuple[str, str]]:
    name = f"choice {choice.index}"
    if choice.finish_reason not in ("length", "stop"):
        return [("finish_missing", f"{name} ended with finish_reason {choice.finish_reason!r}")]
    problems = [("stop_in_text", f"{name}: stop {stop!r} in {short(choice.text, 80)!r}")
                for stop in plan.stops if stop in choice.text]
    if plan.grammar and choice.finish_reason == "stop" and grammar_problem(plan.grammar, choice.text):
        problems.append(("grammar_mismatch", f"{name} ({plan.grammar}): {grammar_problem(plan.grammar, choice.text)}"))
    if choice.tokens is not None and count is not None and choice.tokens != count:
        problems.append(("token_count_mismatch", f"{name}: completion_tokens {count} but {choice.tokens} tokens sent"))
    if choice.logprob_entries is not None and choice.logprob_entries != choice.tokens:
        problems.append(("logprobs_wrong", f"{name}: {choice.logprob_entries} logprobs for {choice.tokens} output_ids"))
    if plan.endpoint == "generate" and not (choice.prompt_tokens or 0) > 0:
        problems.append(("usage_mismatch", f"{name}: prompt_tokens {choice.prompt_tokens}"))
    if count is None:
        return problems
    if count > plan.max_tokens:
        problems.append(("over_max_tokens", f"{name}: {count} tokens, max_tokens {plan.max_tokens}"))
    # finish_reason is length or stop here: reaching max_tokens may also match a stop at the last token
    if choice.finish_reason == "length" and count != plan.max_tokens:
        problems.append(("finish_reason_wrong", f"{name}: finish_reason length with {count} of {plan.max_tokens}"))
    return problems


def check_usage(plan: Plan, completion: Completion) -> list[tuple[str, str]]:
    usage = completion.usage
    if usage is None:
        expected = not plan.stream or plan.include_usage
        return [("usage_missing", f"{plan.kind} without usage")] if expected else []
    prompt, done, total = (usage.get(key) for key in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if not all(isinstance(value, int) for value in (prompt, done, total)):
        return [("usage_mismatch", f"usage not integers: {usage}")]
    problems = []
    if prompt <= 0 or total != prompt + done:
        problems.append(("usage_mismatch", f"usage {usage}"))
    if done > plan.n * plan.max_tokens:
        problems.append(("over_max_tokens", f"completion_tokens {done} > n {plan.n} x max_tokens {plan.max_tokens}"))
    counts = [choice.tokens for choice in completion.choices.values()]
    if plan.logprobs and None not in counts and sum(counts) != done:
        problems.append(("token_count_mismatch", f"completion_tokens {done} but {sum(counts)} tokens sent"))
    finishes = [choice.finish_reason for choice in completion.choices.values()]
    if plan.n > 1 and finishes and all(f == "length" for f in finishes) and done != plan.n * plan.max_tokens:
        problems.append(("finish_reason_wrong", f"all {plan.n} choices hit length, completion_tokens {done}"))
    return problems


# ---- determinism across the run ---------------------------------------------------------

@dataclass
class FirstAnswer:
    text: str
    request: int
    choice: int


class Determinism:
    """Keeps the first text per key and compares later ones: greedy requests with the same prompt,
    max_tokens, stops and endpoint (any n, streamed or not) give the same text; seeded ones too,
    choice i sampling with seed + i."""

    def __init__(self):
        self.first: dict[tuple, FirstAnswer] = {}
        self.compared = {"greedy": 0, "seeded": 0}

    def record(self, plan: Plan, completion: Completion) -> list[tuple[str, str]]:
        if plan.determinism_key is None:
            return []
        mode = "seeded" if plan.seed is not None else "greedy"
        problems = []
        for choice in completion.choices.values():
            key = plan.determinism_key if plan.seed is None else (*plan.determinism_key, plan.seed + choice.index)
            first = self.first.setdefault(key, FirstAnswer(choice.text, plan.index, choice.index))
            if (first.request, first.choice) == (plan.index, choice.index):
                continue
            self.compared[mode] += 1
            if choice.text != first.text:
                problems.append((f"{mode}_mismatch", f"choice {choice.index}: {short(choice.text, 80)!r} != "
                                 f"request {first.request} choice {first.choice}: {short(first.text, 80)!r} "
                                 f"(key {short(key, 120)})"))
        return problems

    def stats(self) -> dict:
        return {"keys": len(self.first), "compared": dict(self.compared)}
