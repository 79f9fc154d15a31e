"""POST /generate in SGLang's native shape.

Body: `text` or `input_ids`, `sampling_params` {max_new_tokens, temperature, ...},
`stream`, `return_logprob`. Answer: `{"text", "output_ids", "meta_info"}` (a list
of those when n > 1); streamed chunks carry the cumulative text and output_ids.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from aiohttp import web

from server.errors import bad_request
from server.metrics import RequestTracker
from server.schemas import (MAX_LOGPROBS, GenerateRequest, build_specs, check_prompt_chars, check_prompt_ids,
                            check_range, check_sampling, check_unsupported, read_request)
from server.streaming import CONTEXT, json_response, ChoiceResult, FrontContext, SequenceSpec, collect, serve_sse

DEFAULT_MAX_NEW_TOKENS = 128     # SGLang's default; capped by what the context has left


async def prompt_ids(ctx: FrontContext, req: GenerateRequest) -> list[int]:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("Give exactly one of `text` and `input_ids`.", param="text", code="invalid_value")
    if isinstance(req.text, list):
        raise bad_request("Batched `text` (a list) is not supported; send one request per prompt.", param="text",
                          code="unsupported_parameter")
    if req.text is not None:
        if not req.text:
            raise bad_request("`text` must not be empty.", param="text", code="invalid_value")
        check_prompt_chars(ctx, len(req.text), "text")
        return await ctx.off_loop(ctx.tokenizer.encode, req.text)
    if req.input_ids and all(isinstance(x, list) for x in req.input_ids):
        raise bad_request("Batched `input_ids` (a list of lists) is not supported; send one request per prompt.",
                          param="input_ids", code="unsupported_parameter")
    if not req.input_ids:
        raise bad_request("`input_ids` must not be empty.", param="input_ids", code="invalid_value")
    return check_prompt_ids(ctx, req.input_ids, "input_ids")


async def plan_generate(ctx: FrontContext, req: GenerateRequest) -> list[SequenceSpec]:
    sp, prefix = req.sampling_params, "sampling_params."
    check_unsupported(req)
    check_unsupported(sp, prefix)
    check_sampling(sp, ctx.vocab_size, prefix)
    check_range(0 <= req.top_logprobs_num <= MAX_LOGPROBS, "top_logprobs_num", f"between 0 and {MAX_LOGPROBS}")
    ids = await prompt_ids(ctx, req)
    logprobs = req.top_logprobs_num if req.return_logprob else None
    return build_specs(uuid.uuid4().hex, [ids], sp, sp.max_new_tokens, prefix + "max_new_tokens",
                       ctx.context_length, logprobs, DEFAULT_MAX_NEW_TOKENS, prefix)


def finish_reason_json(result: ChoiceResult) -> dict | None:
    kind = result.finish_reason
    if kind is None:
        return None
    body = {"type": kind, "matched": result.matched if kind == "stop" else None}
    if kind == "length":
        body["length"] = result.completion_tokens
    elif kind == "abort":
        body["message"] = "aborted by the engine"
    return body


def output_json(ctx: FrontContext, req: GenerateRequest, spec: SequenceSpec, result: ChoiceResult,
                arrival: float, n: int) -> dict:
    meta = {"id": spec.rid, "prompt_tokens": result.prompt_tokens or len(spec.input_ids),
            "completion_tokens": result.completion_tokens, "cached_tokens": result.cached_tokens,
            "finish_reason": finish_reason_json(result), "spec_verify_ct": result.spec_verify_ct,
            "spec_accept_length": result.completion_tokens / result.spec_verify_ct if result.spec_verify_ct else 0.0,
            "e2e_latency": time.perf_counter() - arrival}
    if req.return_logprob:
        name = (lambda t: ctx.token_texts.text(t)) if req.return_text_in_logprobs else (lambda t: None)
        meta["output_token_logprobs"] = [[e.logprob, e.token_id, name(e.token_id)] for e in result.logprobs]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, name(t)] for t, lp in e.top] for e in result.logprobs]
    body = {"text": result.text, "output_ids": list(result.token_ids), "meta_info": meta}
    if n > 1:
        body["index"] = result.index
    return body


async def stream_events(ctx: FrontContext, req: GenerateRequest, specs: list[SequenceSpec],
                        arrival: float) -> AsyncIterator[dict]:
    results = [ChoiceResult(i) for i in range(len(specs))]
    async for update in ctx.run(specs, arrival):
        result = results[update.index]
        result.add(update)
        if update.token_ids or update.text or update.finish_reason:
            yield output_json(ctx, req, specs[update.index], result, arrival, len(specs))


async def generate(request: web.Request, tracker: RequestTracker) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = await read_request(request, GenerateRequest)
    specs = await plan_generate(ctx, req)
    if req.stream:
        return await serve_sse(request, stream_events(ctx, req, specs, tracker.start), tracker)
    results = await collect(ctx.run(specs, tracker.start), len(specs))
    outputs = [output_json(ctx, req, spec, r, tracker.start, len(specs)) for spec, r in zip(specs, results)]
    return json_response(outputs[0] if len(outputs) == 1 else outputs)
