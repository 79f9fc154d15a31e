"""Prefill/decode disaggregation end to end: a prefill node and a decode node as real processes on
127.0.0.1, driven through the decode node's HTTP API. Greedy outputs equal the unified server's for
every speculative algorithm, overlap on and off, --dp-size 2 on both sides, prompts longer than
--chunked-prefill-size and the MoE model; seeded sampling gives the unified server's text; both
nodes end with no KV in use and count their transfers."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import engine, run_batch
from tests.pd_harness import generate, pd_pair, wait_idle
from tests.server_harness import DENSE, MOE, REPO, metric

pytestmark = pytest.mark.slow
NEW_TOKENS = 24
CHUNK = ["--chunked-prefill-size", "32"]
DENSE_CONFIGS = {
    "none": ["--speculative-algorithm", "none"],
    "none-no-overlap": ["--speculative-algorithm", "none", "--disable-overlap-schedule"],
    "eagle": ["--speculative-algorithm", "eagle"],
    "eagle-no-overlap": ["--speculative-algorithm", "eagle", "--disable-overlap-schedule"],
    "eagle3": ["--speculative-algorithm", "eagle3"],
    "standalone": ["--speculative-algorithm", "standalone", "--speculative-disable-by-batch-size", "0"],
    "ngram": ["--speculative-algorithm", "ngram"],
    "eagle-dp2": ["--speculative-algorithm", "eagle", "--dp-size", "2"],
}
MOE_CONFIGS = {
    "moe-none": ["--speculative-algorithm", "none"],
    "moe-eagle": ["--speculative-algorithm", "eagle", "--speculative-draft-model-path",
                  str(REPO / "models" / "tandem-moe-eagle")],
}


def prompts_for(model) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(p) for p in CODE_PROMPTS[:5]]
    prompts.append(tok.encode("".join(CODE_PROMPTS)))          # several chunks of 32
    assert max(map(len, prompts)) > 96
    return prompts


async def unified(flags: list[str], prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async with engine(flags) as client:
        return [tokens for tokens, _ in await run_batch(client, prompts, params)]


@pytest.fixture(scope="module")
def references():
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    cache = {}
    for model in (DENSE, MOE):
        prompts = prompts_for(model)
        cache[model] = prompts, asyncio.run(unified(["--model-path", str(model), "--speculative-algorithm", "none"],
                                                    prompts, greedy))
    return cache


async def run_pair(flags: list[str], model, prompts, log_dir) -> tuple[list[list[int]], str, str]:
    common = ["--model-path", str(model), *CHUNK, *flags]
    with pd_pair([], [], log_dir, common=common) as pair:
        async with aiohttp.ClientSession() as session:
            jobs = [generate(session, pair.url, ids, NEW_TOKENS) for ids in prompts]
            outputs = await asyncio.wait_for(asyncio.gather(*jobs), 300)
            decode_metrics, prefill_metrics = await wait_idle(session, pair.url, pair.prefill.url)
    return [o["output_ids"] for o in outputs], decode_metrics, prefill_metrics


@pytest.mark.parametrize("config", [*DENSE_CONFIGS, *MOE_CONFIGS])
async def test_pd_greedy_equals_unified(config, references, tmp_path):
    model = MOE if config in MOE_CONFIGS else DENSE
    flags = MOE_CONFIGS.get(config) or DENSE_CONFIGS[config]
    prompts, reference = references[model]
    outputs, decode_metrics, prefill_metrics = await run_pair(flags, model, prompts, tmp_path)
    assert outputs == reference
    for text in (decode_metrics, prefill_metrics):
        assert metric(text, 'tandem_pd_rooms_finished_total{state="done"}') == len(prompts)
        assert metric(text, 'tandem_pd_rooms_finished_total{state="failed"}') == 0
        assert metric(text, "tandem_pd_transferred_bytes_total") > 0


@pytest.mark.parametrize("config", ["eagle", "none"])
async def test_pd_seeded_sampling_equals_unified(config, tmp_path):
    prompts = prompts_for(DENSE)[:4]
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    seeded = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **params)
    flags = DENSE_CONFIGS[config]
    reference = await unified(["--model-path", str(DENSE), *CHUNK, *flags], prompts, seeded)
    with pd_pair([], [], tmp_path, common=["--model-path", str(DENSE), *CHUNK, *flags]) as pair:
        async with aiohttp.ClientSession() as session:
            outputs = [await generate(session, pair.url, ids, NEW_TOKENS, **params) for ids in prompts]
    assert [o["output_ids"] for o in outputs] == reference


async def test_transfers_appear_in_each_nodes_trace(tmp_path):
    import json
    traces = {role: tmp_path / f"{role}.trace.json" for role in ("prefill", "decode")}
    prompts = prompts_for(DENSE)[:3]
    with pd_pair(["--trace-file", str(traces["prefill"])], ["--trace-file", str(traces["decode"])], tmp_path,
                 common=["--model-path", str(DENSE), *CHUNK, "--speculative-algorithm", "none"]) as pair:
        async with aiohttp.ClientSession() as session:
            for ids in prompts:
                await generate(session, pair.url, ids, 4)
    spans = {role: [e for e in json.loads(path.read_text()) if e.get("ph") == "X" and e.get("tid") == 5]
             for role, path in traces.items()}
    assert [e["args"]["tokens"] for e in spans["prefill"]] == [len(ids) for ids in prompts]
    assert [e["args"]["tokens"] for e in spans["decode"]] == [len(ids) for ids in prompts]
    assert all(e["name"].startswith("kv in") and e["dur"] > 0 for e in spans["decode"])
