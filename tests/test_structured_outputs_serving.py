"""Structured outputs through a real server (run.py's default: EAGLE, overlap) and real clients: the
openai package's response_format (json_schema with strict, json_object) on chat and completions,
SGLang's regex and ebnf (extra_body) and /generate's json_schema; streaming, n > 1 with seeds, stop
strings and logprobs under a grammar; a schema xgrammar cannot compile gets a 400 that names the
problem while a request beside it runs undisturbed; the compiled-grammar cache."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.grammars import EBNF, REGEX, SCHEMAS, problem
from tests.server_harness import metric, running_server

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
MODEL = "tandem-dense"
PROMPT = "def fibonacci(n):\n"
UNCOMPILABLE = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[unclosed"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--max-running-requests", "8"], tmp_path_factory.mktemp("srv") / "server.log") as srv:
        yield srv


def schema_format(name: str, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name],
                                                   "strict": strict}}


async def test_chat_and_completions_follow_a_json_schema(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a user."}], max_tokens=80, temperature=0,
        response_format=schema_format("nested"))
    assert chat.choices[0].finish_reason == "stop"
    assert problem("nested", chat.choices[0].message.content) is None
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=80, temperature=0,
                                                 extra_body={"response_format": schema_format("pattern-and-range")})
    assert completion.choices[0].finish_reason == "stop"
    assert problem("pattern-and-range", completion.choices[0].text) is None
    loose = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Any JSON."}], max_tokens=8, temperature=0,
        response_format={"type": "json_object"})
    assert loose.choices[0].message.content.startswith("{")


async def test_a_stream_of_n_seeded_choices_with_logprobs_follows_a_regex(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=5,
                                             n=3, logprobs=2, stream=True, extra_body={"regex": REGEX})
    texts, reasons, logprobs = ["", "", ""], [None] * 3, [0, 0, 0]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            logprobs[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
    assert reasons == ["stop"] * 3, texts
    assert all(problem("regex", text) is None for text in texts), texts
    assert all(count > 0 for count in logprobs)
    whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=5,
                                            n=3, extra_body={"regex": REGEX})
    assert [c.text for c in whole.choices] == texts                      # seeded: streamed or whole alike


async def test_generate_takes_a_schema_and_ebnf_and_a_stop_string_cuts_a_grammar(server):
    async with aiohttp.ClientSession() as http:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 80, "temperature": 0,
                                                    "json_schema": json.dumps(SCHEMAS["array-of-objects"])}}
        async with http.post(server.url + "/generate", json=body) as response:
            answer = await response.json()
        assert answer["meta_info"]["finish_reason"]["type"] == "stop", answer
        assert problem("array-of-objects", answer["text"]) is None
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ebnf": EBNF}}
        async with http.post(server.url + "/generate", json=body) as response:
            answer = await response.json()
        assert problem("ebnf", answer["text"]) is None
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    cut = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[","],
                                          extra_body={"regex": REGEX})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text in ("yes", "no")


async def test_a_schema_that_cannot_compile_is_refused_and_disturbs_nothing(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")

    async def free_text() -> str:
        done = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0)
        return done.choices[0].text
    alone = await free_text()
    beside = asyncio.create_task(free_text())
    with pytest.raises(BadRequestError) as refused:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": UNCOMPILABLE}})
    assert "grammar" in refused.value.message and "[" in refused.value.message
    with pytest.raises(BadRequestError):
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
                                        extra_body={"ebnf": "root ::= undefined_rule"})
    assert await beside == alone


async def test_a_grammar_is_compiled_once_and_counted(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    async with aiohttp.ClientSession() as http:
        async def counters() -> tuple[float, float]:
            await asyncio.sleep(1.2)                # the rank reports every half second
            async with http.get(server.url + "/metrics") as response:
                text = await response.text()
            return metric(text, "tandem_grammar_requests_total"), metric(text, "tandem_grammar_compilations_total")
        before = await counters()
        for _ in range(3):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            extra_body={"response_format": schema_format("bounded-enum-array",
                                                                                         strict=False)})
        after = await counters()
    assert after[0] - before[0] == 3 and after[1] - before[1] == 1
