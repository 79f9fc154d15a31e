"""Structured outputs across processes: DP attention on the embedded MoE model (real rank processes in a
torch.distributed group, each rank compiling its requests' grammars) gives one rank's constrained
greedy outputs, with speculation on and off; a prefill node masks the first token, the decode node's
matcher takes it and goes on, and the pair answers as one unified server does."""
from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import engine, run_batch
from tests.grammars import GRAMMARS, REGEX, SCHEMAS, problem
from tests.pd_harness import generate, pd_pair, wait_idle
from tests.server_harness import DENSE, MOE, running_server
from tests.test_dp_attention import ALGORITHMS, DP

pytestmark = pytest.mark.slow
NAMES = ["nested", "bounded-enum-array", "pattern-and-range", "regex", "ebnf"]


def jobs(model) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each grammar after two prompts, and two free requests, greedy."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(CODE_PROMPTS[i]) for i in (0, 2)]
    free = SamplingParams(max_new_tokens=48, temperature=0)
    params = [msgspec.structs.replace(free, grammar=GRAMMARS[name]) for name in NAMES for _ in prompts] + [free] * 2
    return [p for _ in NAMES for p in prompts] + prompts, params


async def outputs(flags: list[str]) -> list[tuple[list[int], str]]:
    ids, params = jobs(MOE)
    async with engine(["--model-path", str(MOE), "--chunked-prefill-size", "32", *flags]) as client:
        done = await run_batch(client, ids, params, timeout=300)
    return [(tokens, last.finish_reason) for tokens, last in done]


@pytest.fixture(scope="module")
def one_rank():
    return asyncio.run(outputs([*ALGORITHMS["none"], "--disable-overlap-schedule"]))


@pytest.mark.asyncio
@pytest.mark.parametrize("algorithm", ["none", "eagle"])
async def test_dp_attention_constrained_greedy_equals_one_rank(algorithm, one_rank):
    got = await outputs([*DP, *ALGORITHMS[algorithm], "--dp-size", "2"])
    assert got == one_rank
    assert sum(reason == "stop" for _, reason in got[:-2]) >= len(NAMES)     # most grammars reached their end


@pytest.mark.asyncio
async def test_pd_constrained_outputs_equal_a_unified_server(tmp_path):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(DENSE).encode(CODE_PROMPTS[2])
    asks = [{"regex": REGEX}, {"json_schema": SCHEMAS["nested"]}, {"ebnf": GRAMMARS["ebnf"].source}]

    async def answers(url: str) -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[generate(session, url, ids, 64, ignore_eos=False, **ask) for ask in asks])
    with running_server([], tmp_path / "unified.log") as unified:
        expected = await answers(unified.url)
    with pd_pair([], [], tmp_path) as pair:
        got = await answers(pair.url)
        async with aiohttp.ClientSession() as session:
            await wait_idle(session, pair.url, pair.prefill.url)
    assert [a["output_ids"] for a in got] == [a["output_ids"] for a in expected]
    for answer, name in zip(got, ["regex", "nested", "ebnf"]):
        assert answer["meta_info"]["finish_reason"]["type"] == "stop"
        assert problem(name, answer["text"]) is None
