"""The unified server end to end, on the embedded model, through real processes and
sockets: greedy outputs against transformers, the OpenAI SDK, bad input, client
disconnects, load, retraction, and a dying rank."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import torch

from tests.e2e_prompts import CODE_PROMPTS
from tests.server_harness import DENSE, metric, running_server

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
CONFIGS = {
    "plain+overlap": ["--speculative-algorithm", "none"],
    "plain-no-overlap": ["--speculative-algorithm", "none", "--disable-overlap-schedule"],
    "plain+4-steps": ["--speculative-algorithm", "none", "--num-scheduler-steps", "4"],
    "eagle+overlap": [],
    "eagle-no-overlap": ["--disable-overlap-schedule"],
    "eagle+4-rounds": ["--num-scheduler-steps", "4"],
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DENSE)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in CODE_PROMPTS[:8]]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request, tmp_path_factory):
    with running_server(CONFIGS[request.param], tmp_path_factory.mktemp("srv") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    with running_server([], tmp_path_factory.mktemp("default") / "server.log") as srv:
        yield srv


async def generate(session, url, ids, max_new=NEW_TOKENS, **params):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True,
                                                   **params}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_greedy_matches_transformers_concurrently(server, prompt_ids, hf_greedy):
    async with aiohttp.ClientSession() as session:
        outs = await asyncio.wait_for(asyncio.gather(*[generate(session, server.url, ids) for ids in prompt_ids]), 300)
    for out, ref in zip(outs, hf_greedy):
        assert out["output_ids"] == ref
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS


async def test_openai_sdk_streams_chat_and_completions(default_server):
    import openai
    client = openai.AsyncOpenAI(base_url=default_server.url + "/v1", api_key="none", timeout=60)
    chunks = []
    stream = await client.completions.create(model="tandem-dense", prompt=CODE_PROMPTS[0], max_tokens=20,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        chunks.append(chunk)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 20
    whole = await client.completions.create(model="tandem-dense", prompt=CODE_PROMPTS[0], max_tokens=20, temperature=0)
    assert whole.choices[0].text == text
    chat = await client.chat.completions.create(model="tandem-dense", max_tokens=16, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "write a loop"}])
    pieces = [c.choices[0].delta.content or "" async for c in chat if c.choices]
    assert len(pieces) >= 2
    await client.close()


def test_the_front_maps_no_torch(default_server):
    """The front tokenizes and streams; torch lives in the ranks only (server/launch.py: load_tokenizer)."""
    maps = Path(f"/proc/{default_server.process.pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    assert "libtorch" not in maps.read_text()
    ranks = default_server.rank_pids()
    assert ranks and all("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in ranks)


def test_the_plain_fast_tokenizer_is_what_autotokenizer_gives(tokenizer):
    from transformers import PreTrainedTokenizerFast

    from engine.args import parse_args
    from server.launch import load_tokenizer
    plain = load_tokenizer(parse_args(["--model-path", str(DENSE)]))
    assert type(plain) is PreTrainedTokenizerFast
    text = "def f(x):\n    return x  # héllo 😀"
    chat = [{"role": "user", "content": text}]
    assert plain.encode(text) == tokenizer.encode(text)
    assert plain.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (plain.eos_token_id, plain.all_special_ids) == (tokenizer.eos_token_id, tokenizer.all_special_ids)


async def test_sse_framing_on_raw_bytes(default_server):
    body = {"model": "tandem-dense", "prompt": CODE_PROMPTS[1], "max_tokens": 12, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(default_server.url + "/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event[len("data: "):])


async def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(default_server, prompt_ids):
    url = default_server.url
    cases = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"model": "tandem-dense", "prompt": "x", "max_tokens": "many"}, 400),
        ("/v1/completions", {"model": "tandem-dense", "prompt": "x", "temperature": -1}, 400),
        ("/v1/chat/completions", {"model": "tandem-dense", "messages": []}, 400),
        ("/v1/completions", {"model": "tandem-dense", "prompt": "x", "max_tokens": 100000}, 400),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
        ("/generate", {"input_ids": [10 ** 9]}, 400),
    ]
    async with aiohttp.ClientSession() as session:
        for path, body, status in cases:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with session.post(url + path, **kwargs) as resp:
                assert resp.status == status, (path, body, await resp.text())
                error = (await resp.json())["error"]
                assert error["message"] and {"type", "param", "code"} <= set(error)
        out = await generate(session, url, prompt_ids[0], max_new=4)
        assert out["meta_info"]["completion_tokens"] == 4


async def wait_for_idle_kv(session, url, timeout=20.0, after_steps: float = 0.0) -> str:
    """/metrics once the rank reports no KV in use, nothing running or waiting, and more than
    `after_steps` scheduler steps (so the report is from after the work of interest)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        fresh = metric(text, "tandem_kv_slots_total") > 0 and metric(text, "tandem_steps_total") > after_steps
        idle = (metric(text, "tandem_kv_slots_used") == 0 and metric(text, "tandem_num_running_reqs") == 0
                and metric(text, "tandem_num_waiting_reqs") == 0)
        if fresh and idle:
            return text
        assert asyncio.get_running_loop().time() < deadline, "KV slots still in use:\n" + text
        await asyncio.sleep(0.3)


async def test_client_disconnect_mid_stream_frees_kv(default_server):
    """The KV comes back while the requests would still be running: the rank emitted far fewer
    tokens than one of them alone would have (speculative steps count every emitted token)."""
    body = {"model": "tandem-dense", "prompt": CODE_PROMPTS[2], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    emitted = "tandem_spec_accept_length_per_step_sum"
    async with aiohttp.ClientSession() as session:
        before = await wait_for_idle_kv(session, default_server.url)
        for _ in range(3):
            resp = await session.post(default_server.url + "/v1/completions", json=body)
            await resp.content.readline()
            await resp.content.readline()
            resp.close()                                   # the client goes away mid-stream
        text = await wait_for_idle_kv(session, default_server.url,
                                      after_steps=metric(before, "tandem_steps_total"))
        assert metric(text, "tandem_kv_slots_total") > 0
        assert 0 < metric(text, emitted) - metric(before, emitted) < 1500


def mixed_requests(prompt_ids, count=64):
    reqs = []
    for i in range(count):
        ids = prompt_ids[i % len(prompt_ids)]
        reqs.append((ids[: 3 + (i * 7) % len(ids)] if len(ids) > 3 else ids, 8 + (i * 13) % 40))
    return reqs


async def run_all(url, reqs):
    async with aiohttp.ClientSession() as session:
        return await asyncio.wait_for(asyncio.gather(*[generate(session, url, ids, max_new=n) for ids, n in reqs]), 600)


async def test_64_concurrent_requests_and_retraction_keep_outputs_identical(default_server, prompt_ids, tmp_path):
    reqs = mixed_requests(prompt_ids)
    unpressured = await run_all(default_server.url, reqs)
    assert [o["meta_info"]["completion_tokens"] for o in unpressured] == [n for _, n in reqs]
    with running_server(["--max-total-tokens", "400"], tmp_path / "tiny.log") as tiny:
        pressured = await run_all(tiny.url, reqs)
        async with aiohttp.ClientSession() as session:
            text = await wait_for_idle_kv(session, tiny.url)
    assert metric(text, "tandem_retractions_total") > 0
    assert [o["output_ids"] for o in pressured] == [o["output_ids"] for o in unpressured]


async def test_dead_rank_fails_requests_and_health_until_it_is_back(tmp_path, prompt_ids):
    with running_server(["--speculative-algorithm", "none"], tmp_path / "dying.log") as srv:
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(generate(session, srv.url, prompt_ids[0], max_new=1900))
            await asyncio.sleep(1.0)
            for pid in srv.rank_pids():
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(AssertionError):          # the request ends with an error status, not a hang
                await asyncio.wait_for(pending, 30)
            async with session.get(srv.url + "/health") as resp:
                assert resp.status == 503                # while the new rank loads the model
            body = {"input_ids": prompt_ids[0], "sampling_params": {"max_new_tokens": 4}}
            async with session.post(srv.url + "/generate", json=body) as resp:
                assert resp.status == 503
                assert "error" in await resp.json()
            await asyncio.to_thread(srv.wait_ranks, 1)
            async with session.post(srv.url + "/generate", json=body) as resp:
                assert resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 4
