"""POST /v1/completions and POST /v1/chat/completions.

Each handler validates the body into a `Plan` (engine requests plus a response
formatter); `run_plan` then streams it as SSE or answers it whole.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from aiohttp import web

from server.errors import bad_request
from server.metrics import RequestTracker
from server.openai_format import ChatFormat, CompletionFormat, OpenAIFormat
from server.schemas import (MAX_LOGPROBS, ChatCompletionRequest, ChatMessage, CompletionRequest, build_specs,
                            check_model, check_prompt_chars, check_prompt_ids, check_range, check_sampling,
                            check_unsupported, read_request)
from server.streaming import CONTEXT, json_response, FrontContext, SequenceSpec, collect, serve_sse

MAX_PROMPTS = 64


@dataclass
class Plan:
    specs: list[SequenceSpec]
    fmt: OpenAIFormat
    stream: bool
    include_usage: bool


def completion_items(prompt: str | list) -> list[str | list]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists: one item per prompt."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(type(x) is int for x in prompt):
        items = [prompt]
    elif prompt and (all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt)):
        items = list(prompt)
    elif not prompt:
        raise bad_request("`prompt` must not be empty.", param="prompt", code="invalid_value")
    else:
        raise bad_request("`prompt` must be a string, a list of strings, a list of token ids, or a list of "
                          "token-id lists.", param="prompt", code="invalid_type")
    check_range(len(items) <= MAX_PROMPTS, "prompt", f"at most {MAX_PROMPTS} prompts")
    return items


async def completion_prompts(prompt: str | list, ctx: FrontContext) -> list[list[int]]:
    """Every prompt checked for size first, then the texts tokenized off the event loop."""
    items = completion_items(prompt)
    params = ["prompt" if len(items) == 1 else f"prompt[{i}]" for i in range(len(items))]
    for item, param in zip(items, params):
        if not item:
            raise bad_request(f"`{param}` must not be empty.", param=param, code="invalid_value")
        if isinstance(item, str):
            check_prompt_chars(ctx, len(item), param)
        else:
            check_prompt_ids(ctx, item, param)
    return [await ctx.off_loop(ctx.tokenizer.encode, item) if isinstance(item, str) else item
            for item in items]


async def plan_completion(ctx: FrontContext, req: CompletionRequest) -> Plan:
    check_model(req.model, ctx.model_name)
    check_unsupported(req)
    check_sampling(req, ctx.vocab_size)
    if req.logprobs is not None:
        check_range(0 <= req.logprobs <= MAX_LOGPROBS, "logprobs", f"between 0 and {MAX_LOGPROBS}")
        if req.echo:
            raise bad_request("`echo` with `logprobs` is not supported (no prompt logprobs).", param="echo",
                              code="unsupported_parameter")
    prompts = await completion_prompts(req.prompt, ctx)
    rid = f"cmpl-{uuid.uuid4().hex}"
    specs = build_specs(rid, prompts, req, req.max_tokens, "max_tokens", ctx.context_length, req.logprobs)
    echo = [ctx.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts] if req.echo else None
    fmt = CompletionFormat(rid, ctx.model_name, ctx.token_texts, sum(map(len, prompts)), req.logprobs is not None,
                           echo_texts=echo, choices_per_prompt=req.n)
    return Plan(specs, fmt, req.stream, bool(req.stream_options and req.stream_options.include_usage))


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "\n".join(part.text for part in message.content)


def render_chat(tokenizer, conversation: list[dict]) -> list[int]:
    """The chat template's text, tokenized (runs in the tokenize pool)."""
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:     # a template refusing the conversation is the user's input
        raise bad_request(f"The messages do not fit the model's chat template: {exc}", param="messages",
                          code="invalid_value") from None
    return tokenizer(text, add_special_tokens=False).input_ids


async def chat_prompt(ctx: FrontContext, messages: list[ChatMessage]) -> list[int]:
    if not messages:
        raise bad_request("`messages` must not be empty.", param="messages", code="invalid_value")
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
                    for m in messages]
    # The template only adds text, so the contents alone already bound the prompt's size.
    check_prompt_chars(ctx, sum(len(m["content"]) for m in conversation), "messages")
    return await ctx.off_loop(render_chat, ctx.tokenizer, conversation)


async def plan_chat(ctx: FrontContext, req: ChatCompletionRequest) -> Plan:
    check_model(req.model, ctx.model_name)
    check_unsupported(req)
    check_sampling(req, ctx.vocab_size)
    if req.top_logprobs is not None:
        check_range(0 <= req.top_logprobs <= MAX_LOGPROBS, "top_logprobs", f"between 0 and {MAX_LOGPROBS}")
        if not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs",
                              code="invalid_value")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = await chat_prompt(ctx, req.messages)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    specs = build_specs(rid, [prompt], req, limit, param, ctx.context_length, logprobs)
    fmt = ChatFormat(rid, ctx.model_name, ctx.token_texts, len(prompt), req.logprobs)
    return Plan(specs, fmt, req.stream, bool(req.stream_options and req.stream_options.include_usage))


async def stream_events(ctx: FrontContext, plan: Plan, arrival: float) -> AsyncIterator[dict]:
    completion_tokens, cached_tokens = {}, 0
    async for update in ctx.run(plan.specs, arrival):
        completion_tokens[update.index] = update.completion_tokens
        cached_tokens = max(cached_tokens, update.cached_tokens)
        chunk = plan.fmt.chunk(update)
        if chunk is not None:
            yield chunk
    if plan.include_usage:
        yield plan.fmt.usage_chunk(sum(completion_tokens.values()), cached_tokens)


async def run_plan(request: web.Request, tracker: RequestTracker, plan: Plan) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    if plan.stream:
        return await serve_sse(request, stream_events(ctx, plan, tracker.start), tracker)
    results = await collect(ctx.run(plan.specs, tracker.start), len(plan.specs))
    return json_response(plan.fmt.whole(results))


async def completions(request: web.Request, tracker: RequestTracker) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = await read_request(request, CompletionRequest)
    return await run_plan(request, tracker, await plan_completion(ctx, req))


async def chat_completions(request: web.Request, tracker: RequestTracker) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = await read_request(request, ChatCompletionRequest)
    return await run_plan(request, tracker, await plan_chat(ctx, req))

