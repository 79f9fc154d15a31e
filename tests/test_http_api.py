"""The HTTP front (server/app.py) against FakeEngine, over real sockets on 127.0.0.1."""
from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from engine.args import ServerArgs
from server.app import create_app
from server.engine_client import EngineRejected
from tests.fake_engine import FakeEngine, build_test_tokenizer, byte_token_ids

pytestmark = pytest.mark.asyncio
MODEL = "tandem-test"
SCRIPT = "Hello world, the quick brown fox jumps over the lazy dog."


def bounded(seconds: float = 30):
    """Fail a test that runs longer than `seconds` instead of hanging the suite."""
    def decorate(test):
        @functools.wraps(test)
        async def run(*args, **kwargs):
            async with asyncio.timeout(seconds):
                return await test(*args, **kwargs)
        return run
    return decorate


@dataclass
class Harness:
    url: str
    engine: FakeEngine
    http: aiohttp.ClientSession

    def openai(self, api_key: str = "unused") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=20)

    async def post(self, path: str, body, headers=None) -> tuple[int, dict | list]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.http.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def sse(self, path: str, body) -> tuple[aiohttp.ClientResponse, bytes]:
        async with self.http.post(self.url + path, json=body) as resp:
            return resp, await resp.read()

    async def metrics(self) -> dict[str, float]:
        async with self.http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return {(s.name + "".join(f"{{{v}}}" for v in s.labels.values())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    async def idle(self) -> None:
        while self.engine.active:
            await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest_asyncio.fixture
async def start(tokenizer):
    runners, sessions = [], []

    async def start_server(context_length: int = 256, engine: FakeEngine | None = None,
                           handler_cancellation: bool = False, **args) -> Harness:
        """Serve on a free port of 127.0.0.1 as server/launch.py does (AppRunner + TCPSite)."""
        engine = engine or FakeEngine(tokenizer)
        engine.script_text(tokenizer, SCRIPT)
        app = create_app(ServerArgs(served_model_name=MODEL, **args), engine, tokenizer, context_length)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        sessions.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)))
        return Harness(f"http://{host}:{port}", engine, sessions[-1])

    yield start_server
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()


def script_ids(tokenizer) -> list[int]:
    return tokenizer.encode(SCRIPT, add_special_tokens=False)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body, checking the framing: every event is `data: ...` ended by a blank line."""
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == ""
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event
    return [event[len("data: "):] for event in events[:-1]]


# ---- happy paths -----------------------------------------------------------------------

@bounded()
async def test_openai_client_completions_and_chat(start, tokenizer):
    h = await start()
    client = h.openai()
    try:
        done = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=50)
        assert done.id.startswith("cmpl-") and done.choices[0].text == SCRIPT
        assert done.choices[0].finish_reason == "stop"
        script_len = len(script_ids(tokenizer)) + 1      # + EOS, which the engine generated
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(tokenizer.encode("Say hi")), script_len)
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_completion_tokens=3)
        assert chat.id.startswith("chatcmpl-") and chat.choices[0].finish_reason == "length"
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
        assert chat.choices[0].message.content == tokenizer.decode(script_ids(tokenizer)[:3])

        text, usage = "", None
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == SCRIPT and usage.completion_tokens == script_len

        parts = [c.choices[0].text async for c in await client.completions.create(
            model=MODEL, prompt="Say hi", stream=True, max_tokens=50)]
        assert "".join(parts) == SCRIPT
    finally:
        await client.close()


@bounded()
async def test_sse_framing_and_usage_chunk(start):
    h = await start()
    resp, raw = await h.sse("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == SCRIPT


@bounded()
async def test_generate_native_shape(start, tokenizer):
    h = await start()
    status, body = await h.post("/generate", {"text": "Say hi", "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and body["text"] == tokenizer.decode(script_ids(tokenizer)[:4])
    assert body["output_ids"] == script_ids(tokenizer)[:4]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 4
    assert meta["prompt_tokens"] == len(tokenizer.encode("Say hi")) and meta["e2e_latency"] >= 0
    assert {"id", "spec_verify_ct", "spec_accept_length"} <= meta.keys()

    status, body = await h.post("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2})
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": h.engine.eos_id}
    assert len(body["meta_info"]["output_token_logprobs"]) == body["meta_info"]["completion_tokens"]
    assert all(len(row) == 2 for row in body["meta_info"]["output_top_logprobs"])

    resp, raw = await h.sse("/generate", {"text": "Say hi", "stream": True, "sampling_params": {"max_new_tokens": 6}})
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]      # cumulative
    assert chunks[-1]["text"] == tokenizer.decode(script_ids(tokenizer)[:6])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


@bounded()
async def test_n_choices_seeds_and_several_prompts(start):
    h = await start()
    status, body = await h.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3, "seed": 7, "max_tokens": 5})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [p.seed for _, _, p in h.engine.requests] == [7, 8, 9]
    assert len({rid for rid, _, _ in h.engine.requests}) == 3
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["prompt_tokens"] == len(h.engine.requests[0][1])

    status, body = await h.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2,
                                                         "temperature": 0, "max_tokens": 4})
    assert status == 200 and body["choices"][0]["message"] == body["choices"][1]["message"]

    resp, raw = await h.sse("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2,
                                                     "stream": True})
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content", "") for c in mine) == SCRIPT

    status, body = await h.post("/v1/completions", {"prompt": ["one", "two"], "n": 2, "max_tokens": 2})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


@bounded()
async def test_logprob_shapes(start):
    h = await start()
    status, body = await h.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0

    status, body = await h.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 3, "logprobs": True, "top_logprobs": 3})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and {"token", "logprob", "bytes", "top_logprobs"} <= content[0].keys()
    assert len(content[0]["top_logprobs"]) == 3

    client = h.openai()
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=4, logprobs=True, top_logprobs=1, stream=True)
        entries = [e async for c in stream if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        assert len(entries) == 4 and all(len(e.top_logprobs) == 1 for e in entries)
    finally:
        await client.close()


@bounded()
async def test_echo_and_default_max_tokens_fill_the_context(start, tokenizer):
    h = await start(context_length=40)
    h.engine.script = None                       # answer with the prompt reversed: never hits EOS
    status, body = await h.post("/v1/completions", {"prompt": "Hello world", "echo": True})
    prompt_tokens = len(tokenizer.encode("Hello world"))
    assert status == 200 and body["choices"][0]["text"].startswith("Hello world")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 40 - prompt_tokens


@bounded()
async def test_models_and_health(start):
    h = await start(context_length=123)
    async with h.http.get(h.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 123
    async with h.http.get(h.url + "/health") as resp:
        assert resp.status == 200 and await resp.json() == {}
    h.engine.dead = True
    async with h.http.get(h.url + "/health") as resp:
        assert resp.status == 503
    status, body = await h.post("/v1/completions", {"prompt": "x"})
    assert status == 503 and body["error"]["code"] == "engine_dead"


# ---- stop strings ----------------------------------------------------------------------

@bounded()
async def test_stop_strings_never_reach_the_text(start, tokenizer):
    h = await start()
    status, body = await h.post("/v1/completions", {"prompt": "x", "stop": ["quick", "never"]})
    assert body["choices"][0]["text"] == "Hello world, the " and body["choices"][0]["finish_reason"] == "stop"
    rid = body["id"]
    assert h.engine.aborts == [(rid, "stop")]
    # completion_tokens: everything generated up to and including the token that completed "quick"
    ids = script_ids(tokenizer)
    upto = next(i for i in range(1, len(ids) + 1) if "quick" in tokenizer.decode(ids[:i]))
    assert body["usage"]["completion_tokens"] == upto

    resp, raw = await h.sse("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "stop": "fox", "stream": True})
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world, the quick brown "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    status, body = await h.post("/generate", {"text": "x", "sampling_params": {"stop": "lazy"}})
    assert body["text"].endswith("over the ") and body["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                       "matched": "lazy"}


@bounded()
async def test_stop_string_split_across_byte_tokens_and_multi_token_deltas(start, tokenizer):
    h = await start(engine=FakeEngine(tokenizer, tokens_per_delta=3))
    h.engine.script = byte_token_ids(tokenizer, "ok 世界😀 then END and more") + [h.engine.eos_id]
    for stream in (False, True):
        body = {"prompt": "x", "stop": ["界😀 t"], "stream": stream}
        if stream:
            _, raw = await h.sse("/v1/completions", body)
            text = "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(raw)[:-1])
        else:
            text = (await h.post("/v1/completions", body))[1]["choices"][0]["text"]
        assert text == "ok 世" and "\ufffd" not in text
    assert [reason for _, reason in h.engine.aborts] == ["stop", "stop"]


@bounded()
async def test_stop_token_ids_are_not_in_the_text(start, tokenizer):
    h = await start()
    stop_id = script_ids(tokenizer)[2]
    status, body = await h.post("/v1/completions", {"prompt": "x", "stop_token_ids": [stop_id]})
    assert body["choices"][0]["text"] == tokenizer.decode(script_ids(tokenizer)[:2])
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "stop"
    status, body = await h.post("/v1/completions", {"prompt": "x", "ignore_eos": True, "max_tokens": 80})
    assert body["usage"]["completion_tokens"] == 80 and body["choices"][0]["finish_reason"] == "length"


# ---- bad input -------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CHAT_PATH = "/v1/chat/completions"
BAD_INPUTS = [
    # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, 400,
     "messages[0].mood", "unsupported_parameter"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "foo": 1}}, 400, "sampling_params.foo",
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.1}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 10**30}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]", "invalid_value"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [1, True]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "s" * 257]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1}, 400, "presence_penalty", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * 10**5}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": ["x", "x" * 10**5]}, 400, "prompt[1]", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1] * 64}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "invalid_type"),
    (CHAT_PATH, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_type"),
    (CHAT_PATH, {"messages": [{"content": "x"}]}, 400, "messages[0].role", "invalid_type"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    # 64 tokens hold at most 64 * 45 characters (45: tandem-dense's longest token): messages refused together
    (CHAT_PATH, {"messages": [{"role": "user", "content": "x" * 2000}] * 2}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, 400, "logprobs", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema.schema", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type",
     "invalid_type"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
     400, "response_format.json_schema.schema", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "regex": ""}, 400, "regex", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "model": "other"}, 404, "model", "model_not_found"),
    ("/generate", {}, 400, "text", "invalid_value"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "text", "invalid_value"),
    ("/generate", {"text": ["a", "b"]}, 400, "text", "unsupported_parameter"),
    ("/generate", {"input_ids": [[1], [2]]}, 400, "input_ids", "unsupported_parameter"),
    ("/generate", {"input_ids": []}, 400, "input_ids", "invalid_value"),
    ("/generate", {"text": ""}, 400, "text", "invalid_value"),
    ("/generate", {"text": "x" * 10**5}, 400, "text", "context_length_exceeded"),
    ("/generate", {"input_ids": [1] * 64}, 400, "input_ids", "context_length_exceeded"),
    ("/generate", {"text": "x", "sampling_params": {"stop": list("abcde")}}, 400, "sampling_params.stop",
     "invalid_value"),
    ("/generate", {"text": "x", "sampling_params": {"stop": "s" * 257}}, 400, "sampling_params.stop",
     "invalid_value"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": 3}}, 400, "sampling_params.temperature",
     "invalid_value"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "x"}}, 400, "sampling_params.max_new_tokens",
     "invalid_type"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, 400,
     "sampling_params.max_new_tokens", "context_length_exceeded"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a+", "ebnf": "root ::= [a]"}}, 400,
     "sampling_params.ebnf", "invalid_value"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": [1]}}, 400, "sampling_params.json_schema",
     "invalid_value"),
    ("/generate", {"text": "x", "sampling_params": []}, 400, "sampling_params", "invalid_type"),
]


@bounded(60)
async def test_bad_inputs_get_openai_errors_and_the_server_keeps_working(start):
    h = await start(context_length=64)
    for path, body, status, param, code in BAD_INPUTS:
        got, answer = await h.post(path, body)
        assert (got, answer["error"]["param"], answer["error"]["code"]) == (status, param, code), (path, body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert h.engine.requests == []
    status, body = await h.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    metrics = await h.metrics()
    assert metrics["tandem_requests_total{rejected}"] == len(BAD_INPUTS)
    assert metrics["tandem_requests_total{error}"] == 0 and metrics["tandem_requests_total{ok}"] == 1


@bounded()
async def test_unknown_routes_and_methods_get_openai_errors(start):
    h = await start()
    async with h.http.get(h.url + "/v1/nothing") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    async with h.http.get(h.url + "/v1/completions") as resp:
        assert resp.status == 405 and "error" in await resp.json()


@bounded()
async def test_api_key(start):
    h = await start(api_key="sekret")
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        status, body = await h.post("/v1/completions", {"prompt": "x"}, headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    async with h.http.get(h.url + "/v1/models") as resp:
        assert resp.status == 401
    for path in ("/health", "/metrics"):
        async with h.http.get(h.url + path) as resp:
            assert resp.status == 200
    status, _ = await h.post("/generate", {"text": "x"}, {"Authorization": "Bearer sekret"})
    assert status == 200
    client = h.openai(api_key="sekret")
    try:
        done = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert done.usage.completion_tokens == 2
    finally:
        await client.close()


@bounded()
async def test_overload_and_mid_stream_rejection(start):
    h = await start()
    h.engine.reject = EngineRejected("too many queued requests", 503)
    status, body = await h.post("/v1/completions", {"prompt": "x"})
    assert status == 503 and body["error"]["code"] == "overloaded"
    resp, raw = await h.sse("/v1/chat/completions", {**CHAT, "stream": True})
    assert resp.status == 503 and json.loads(raw)["error"]["message"] == "too many queued requests"

    h.engine.reject, h.engine.fail_after = None, 3
    resp, raw = await h.sse("/v1/completions", {"prompt": "x", "stream": True})
    events = sse_events(raw)
    assert resp.status == 200 and json.loads(events[-2])["error"]["code"] == "overloaded"
    status, body = await h.post("/generate", {"text": "x"})
    assert status == 503
    metrics = await h.metrics()
    assert metrics["tandem_requests_total{rejected}"] == 4


@bounded()
async def test_server_bugs_become_logged_500_errors(start, caplog):
    h = await start()
    h.engine.reject = RuntimeError("boom")
    for stream in (False, True):
        status, body = await h.post("/v1/completions", {"prompt": "x", "stream": stream})
        assert status == 500 and body["error"]["code"] == "internal_error" and "boom" not in body["error"]["message"]
    h.engine.reject, h.engine.fail_after, h.engine.failure = None, 2, RuntimeError("boom")
    resp, raw = await h.sse("/generate", {"text": "x", "stream": True})
    assert resp.status == 200 and json.loads(sse_events(raw)[-2])["error"]["code"] == "internal_error"
    assert sum("boom" in (r.exc_text or "") or "boom" in str(r.exc_info) for r in caplog.records) == 3
    assert (await h.metrics())["tandem_requests_total{error}"] == 3


@bounded()
async def test_metrics(start):
    h = await start()
    for _ in range(2):
        await h.post("/v1/completions", {"prompt": "x", "max_tokens": 3})
    await h.post("/v1/completions", {"prompt": "x", "temperature": 9})
    m = await h.metrics()
    assert m["tandem_requests_total{ok}"] == 2 and m["tandem_requests_total{rejected}"] == 1
    assert m["tandem_generation_tokens_total"] == 6 and m["tandem_prompt_tokens_total"] > 0
    assert m["tandem_time_to_first_token_seconds_count"] == 2 and m["tandem_e2e_request_latency_seconds_count"] == 2
    assert m["tandem_inter_token_latency_seconds_count"] == 4
    assert m["tandem_num_running_reqs"] == 5 and m["tandem_num_waiting_reqs"] == 1
    assert (m["tandem_kv_slots_used"], m["tandem_kv_slots_total"], m["tandem_steps_total"]) == (150, 2000, 120)
    assert m["tandem_hidden_cpu_fraction"] == pytest.approx(0.7) and m["tandem_retractions_total"] == 1
    assert m["tandem_spec_accept_length"] == pytest.approx(2.5) and m["tandem_spec_off_steps_total"] == 7


# ---- client disconnects ----------------------------------------------------------------

async def wait_for_aborts(h: Harness, count: int) -> None:
    while len(h.engine.aborts) < count or h.engine.active:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("cancel_handlers", [False, True])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "n": 3}),
    ("/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 200}}),
])
@bounded()
async def test_disconnect_mid_stream_aborts_each_request_once(start, tokenizer, path, body, cancel_handlers):
    h = await start(engine=FakeEngine(tokenizer, token_delay=0.02), handler_cancellation=cancel_handlers)
    h.engine.script = None        # the prompt reversed, up to the whole context: long enough to cut
    async with aiohttp.ClientSession() as session:
        async with session.post(h.url + path, json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            resp.connection.transport.close()
    n = body.get("n", 1)
    await wait_for_aborts(h, n)
    await asyncio.sleep(0.1)
    assert sorted(h.engine.aborts) == sorted((rid, "abort") for rid, _, _ in h.engine.requests)
    assert len(h.engine.aborts) == n
    assert (await h.metrics())["tandem_requests_total{abort}"] == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cancel_handlers", [False, True])
@bounded()
async def test_disconnect_before_any_output_aborts_once(start, tokenizer, stream, cancel_handlers):
    """The client leaves while the engine has sent nothing yet (a whole response, or a stream before its headers)."""
    h = await start(engine=FakeEngine(tokenizer, token_delay=0.5), handler_cancellation=cancel_handlers)
    h.engine.script = None
    task = asyncio.create_task(h.post("/v1/completions", {"prompt": "x", "stream": stream}))
    while not h.engine.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    await wait_for_aborts(h, 1)
    await asyncio.sleep(0.1)
    assert h.engine.aborts == [(h.engine.requests[0][0], "abort")]
    assert (await h.metrics())["tandem_requests_total{abort}"] == 1
