"""Prefill/decode disaggregation end to end: a prefill node and a decode node as real processes on
127.0.0.1, driven through the decode node's HTTP API. Greedy outputs equal the unified server's for
every speculative algorithm, overlap on and off, --dp-size 2 on both sides and on the prefill side
only, prompts longer than --chunked-prefill-size and the MoE model; seeded sampling gives the unified
server's text; both nodes end with no KV in use and count their transfers."""
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
    "eagle-dp2-to-dp1": ["--speculative-algorithm", "eagle"],
}
PREFILL_ONLY = {"eagle-dp2-to-dp1": ["--dp-size", "2"]}   # two prefill ranks feeding one decode rank
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


SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
SEEDED_CONFIGS = ("none", "eagle")             # seeded sampling through the pair, too
TRACED_CONFIG = "none"                         # both nodes write --trace-file


@pytest.fixture(scope="module")
def references():
    """Per model: the prompts and the unified server's greedy outputs; per config in SEEDED_CONFIGS: its
    seeded outputs for the first four prompts."""
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **SEEDED)
    cache = {}
    for model in (DENSE, MOE):
        prompts = prompts_for(model)
        cache[model] = prompts, asyncio.run(unified(["--model-path", str(model), "--speculative-algorithm", "none"],
                                                    prompts, greedy))
    for config in SEEDED_CONFIGS:
        flags = ["--model-path", str(DENSE), *CHUNK, *DENSE_CONFIGS[config]]
        cache[config] = asyncio.run(unified(flags, cache[DENSE][0][:4], seeded))
    return cache


@pytest.mark.parametrize("config", [*DENSE_CONFIGS, *MOE_CONFIGS])
async def test_pd_equals_unified(config, references, tmp_path):
    """One pair per configuration, and every check it answers: greedy outputs, the rooms counted on both
    nodes, no KV left in use; seeded sampling (SEEDED_CONFIGS); the transfer spans (TRACED_CONFIG)."""
    model = MOE if config in MOE_CONFIGS else DENSE
    flags = MOE_CONFIGS.get(config) or DENSE_CONFIGS[config]
    prompts, reference = references[model]
    traces = {role: tmp_path / f"{role}.trace.json" for role in ("prefill", "decode")}
    traced = {role: ["--trace-file", str(path)] if config == TRACED_CONFIG else [] for role, path in traces.items()}
    sent = list(prompts)
    prefill_flags = [*traced["prefill"], *PREFILL_ONLY.get(config, [])]
    with pd_pair(prefill_flags, traced["decode"], tmp_path, common=["--model-path", str(model), *CHUNK, *flags]
                 ) as pair:
        async with aiohttp.ClientSession() as session:
            jobs = [generate(session, pair.url, ids, NEW_TOKENS) for ids in prompts]
            outputs = await asyncio.wait_for(asyncio.gather(*jobs), 300)
            assert [o["output_ids"] for o in outputs] == reference
            for text in await wait_idle(session, pair.url, pair.prefill.url):
                assert metric(text, 'tandem_pd_rooms_finished_total{state="done"}') == len(prompts)
                assert metric(text, 'tandem_pd_rooms_finished_total{state="failed"}') == 0
                assert metric(text, "tandem_pd_transferred_bytes_total") > 0
            if config in SEEDED_CONFIGS:
                sent += prompts[:4]
                seeded = [await generate(session, pair.url, ids, NEW_TOKENS, **SEEDED) for ids in prompts[:4]]
                assert [o["output_ids"] for o in seeded] == references[config]
    if config == TRACED_CONFIG:
        check_transfer_spans(traces, sent)


def check_transfer_spans(traces: dict, prompts: list[list[int]]) -> None:
    """Each node's trace has one transfer span per request (tid 5), with the prompt's length."""
    import json
    spans = {role: [e for e in json.loads(path.read_text()) if e.get("ph") == "X" and e.get("tid") == 5]
             for role, path in traces.items()}
    lengths = sorted(len(ids) for ids in prompts)
    assert sorted(e["args"]["tokens"] for e in spans["prefill"]) == lengths
    assert sorted(e["args"]["tokens"] for e in spans["decode"]) == lengths
    assert all(e["name"].startswith("kv in") and e["dur"] > 0 for e in spans["decode"])
