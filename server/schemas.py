"""Request bodies (msgspec Structs) and their checks, ending in engine SamplingParams.

msgspec checks types (a wrong type names its field); the functions here check
ranges and the parameters this engine does not implement. Every failure is an
`APIError` with status 400 that names the parameter.
"""
from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
from aiohttp import web

from engine.messages import GrammarSpec, SamplingParams
from server.errors import APIError, bad_request, from_validation_error
from server.grammar_params import ResponseFormat, grammar_spec
from server.streaming import FrontContext, SequenceSpec

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256        # each stop string is searched for at every output token
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
# A client that sends its headers and then stalls must not hold a handler (and its connection) forever.
BODY_READ_TIMEOUT_S = 60.0


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class CommonSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/completions, /v1/chat/completions and /generate's sampling_params."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    regex: str | None = None            # structured outputs (server/grammar_params.py)
    ebnf: str | None = None
    # Not implemented by the engine: accepted only at their neutral value.
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None


class OpenAIRequest(CommonSampling, kw_only=True):
    model: str | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(OpenAIRequest, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: Any = None
    suffix: Any = None


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


class GenerateSampling(CommonSampling, kw_only=True):
    max_new_tokens: int | None = None
    min_new_tokens: Any = None
    json_schema: Any = None             # a JSON schema (an object, or JSON text)


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str | list[Any] | None = None
    input_ids: list[Any] | None = None
    sampling_params: GenerateSampling = msgspec.field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    image_data: Any = None


# Neutral values of parameters the engine does not implement (None is always neutral).
UNSUPPORTED: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "best_of": (1,), "suffix": ("",), "min_new_tokens": (0,),
    "image_data": (),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "modalities": (["text"],), "prediction": (),
}


async def read_request(request: web.Request, kind: type) -> Any:
    """Read the body within BODY_READ_TIMEOUT_S and under the size limit, then parse it as `kind`."""
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            body = await request.read()
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {BODY_READ_TIMEOUT_S:g} seconds.",
                       code="request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"The request body is larger than this server's limit of {request.client_max_size} "
                       "bytes (--max-request-bytes).", code="request_too_large") from None
    return decode_body(body, kind)


def decode_body(body: bytes, kind: type) -> Any:
    """Parse and type-check a JSON body."""
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


def check_unsupported(req: msgspec.Struct, prefix: str = "") -> None:
    for name, neutral in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and (isinstance(value, bool) or value not in neutral):
            raise bad_request(f"`{prefix}{name}` is not supported by this server.", param=prefix + name,
                              code="unsupported_parameter")


def check_range(ok: bool, param: str, rule: str) -> None:
    if not ok:
        raise bad_request(f"`{param}` must be {rule}.", param=param, code="invalid_value")


def check_sampling(req: CommonSampling, vocab_size: int, prefix: str = "") -> None:
    """Range checks shared by all generation endpoints (written so NaN fails too)."""
    p = prefix
    if req.temperature is not None:
        check_range(0.0 <= req.temperature <= 2.0, p + "temperature", "between 0 and 2")
    if req.top_p is not None:
        check_range(0.0 < req.top_p <= 1.0, p + "top_p", "in (0, 1]")
    if req.top_k is not None:
        check_range(req.top_k >= -1, p + "top_k", "-1 (off), 0 (off) or a positive integer")
    if req.min_p is not None:
        check_range(0.0 <= req.min_p <= 1.0, p + "min_p", "in [0, 1]")
    check_range(1 <= req.n <= MAX_N, p + "n", f"between 1 and {MAX_N}")
    if req.seed is not None:
        check_range(0 <= req.seed <= MAX_SEED - MAX_N, p + "seed", f"between 0 and {MAX_SEED - MAX_N}")
    check_token_ids(req.stop_token_ids or [], vocab_size, p + "stop_token_ids")
    stop_strings(req.stop, p + "stop")


def check_token_ids(ids: list, vocab_size: int, param: str) -> list[int]:
    for tok in ids:
        if type(tok) is not int:
            raise bad_request(f"`{param}` must be a list of integer token ids.", param=param, code="invalid_type")
        check_range(0 <= tok < vocab_size, param, f"token ids in [0, {vocab_size})")
    return ids


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    check_range(len(stops) <= MAX_STOP_STRINGS, param, f"at most {MAX_STOP_STRINGS} strings")
    check_range(all(stops), param, "non-empty strings")
    check_range(all(len(s) <= MAX_STOP_CHARS for s in stops), param,
                f"strings of at most {MAX_STOP_CHARS} characters")
    return stops


def max_token_chars(tokenizer) -> int:
    """The most characters a single token of the vocabulary stands for.

    A vocabulary piece is never shorter than the text it covers (byte-level BPE spells one
    character per byte, sentencepiece one per character and six for a byte-fallback `<0x0A>`),
    and every piece's own decoding is counted too, for vocabularies spelled some other way.
    Added tokens (`<|im_start|>`) are matched in plain text, so they count as well."""
    longest_piece = max(map(len, tokenizer.get_vocab()), default=1)
    decoded = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return max(longest_piece, max(map(len, decoded), default=1), 1)


def check_prompt_chars(ctx: FrontContext, chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a text that makes more tokens than the context holds
    whatever it says: every token covers at most `max_token_chars` of its characters."""
    if chars > ctx.max_prompt_chars:
        raise bad_request(f"`{param}` has {chars} characters; this model's context of {ctx.context_length} tokens "
                          f"holds at most {ctx.max_prompt_chars} characters of text.", param=param,
                          code="context_length_exceeded")


def check_prompt_ids(ctx: FrontContext, ids: list, param: str) -> list[int]:
    """Token ids of a prompt: counted against the context before each id is checked."""
    if len(ids) >= ctx.context_length:
        raise bad_request(f"`{param}` has {len(ids)} tokens, which leaves no room in the context of "
                          f"{ctx.context_length} tokens.", param=param, code="context_length_exceeded")
    return check_token_ids(ids, ctx.vocab_size, param)


def max_new_tokens(requested: int | None, prompt_len: int, context_length: int, param: str,
                   default: int | None = None) -> int:
    """The output budget: `requested`, else `default`, else whatever the context has left."""
    room = context_length - prompt_len
    if room < 1:
        raise bad_request(f"The prompt has {prompt_len} tokens, which leaves no room in the context of "
                          f"{context_length} tokens.", param="prompt", code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    check_range(requested >= 1, param, "at least 1")
    if requested > room:
        raise bad_request(f"This model's context length is {context_length} tokens; the prompt has {prompt_len} "
                          f"and `{param}` asks for {requested}.", param=param, code="context_length_exceeded")
    return requested


def sampling_params(req: CommonSampling, max_tokens: int, seed: int | None, logprobs: int | None,
                    grammar: GrammarSpec | None = None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
    )


def build_specs(rid: str, prompts: list[list[int]], req: CommonSampling, max_tokens: int | None, param: str,
                context_length: int, logprobs: int | None, default_max: int | None = None,
                prefix: str = "") -> list[SequenceSpec]:
    """n choices per prompt; choice i of a prompt samples with seed + i when a seed is given."""
    stops = stop_strings(req.stop)
    grammar = grammar_spec(req, prefix)
    total = len(prompts) * req.n
    specs = []
    for p, ids in enumerate(prompts):
        budget = max_new_tokens(max_tokens, len(ids), context_length, param, default_max)
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            index = p * req.n + i
            specs.append(SequenceSpec(index=index, rid=rid if total == 1 else f"{rid}-{index}", input_ids=ids,
                                      params=sampling_params(req, budget, seed, logprobs, grammar), stops=stops,
                                      skip_special_tokens=req.skip_special_tokens))
    return specs


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`.",
                       param="model", code="model_not_found")
