"""A step that raises ends only its own requests, with an error; the rank frees what they held,
re-plans the batch launched behind it, and keeps serving everyone else with the same greedy
output (against transformers). Faults come from the rank's test hook (engine/faults.py),
injected into real rank processes: on the device stream, in the deferred part of a prefill
(the draft reading the prompt) and while a step is prepared on the CPU. In-process, the KV a
neighbour holds is checked bit for bit across the failure (the batch launched behind a failed
step still runs the failed request's rows: they must write into its own slots only)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.faults import ENV, FaultInjector
from engine.messages import SamplingParams
from server.engine_client import EngineFailed
from tests.e2e_prompts import CODE_PROMPTS
from engine.rank import build_core
from tests.engine_harness import ALGORITHMS, collect, engine
from tests.server_harness import DENSE

pytestmark = pytest.mark.slow
NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# Speculating configs draft every step: plain decodes (the adaptive gate's, or under load) join
# prompt chunks in one batch, and a fault there fails them too, as it does without speculation.
ALWAYS = ["--speculative-adaptive", "off"]
CONFIGS = {
    "eagle+overlap": ALWAYS,
    "eagle-no-overlap": ["--disable-overlap-schedule", *ALWAYS],
    "none+overlap": ["--speculative-algorithm", "none"],
    "none-no-overlap": ["--speculative-algorithm", "none", "--disable-overlap-schedule"],
    "standalone": ["--speculative-algorithm", "standalone", "--speculative-disable-by-batch-size", "0", *ALWAYS],
    "ngram": ["--speculative-algorithm", "ngram", *ALWAYS],
}


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(p) for p in CODE_PROMPTS[:6]]


@pytest.fixture(scope="module")
def hf_greedy(prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.float32)
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]


async def outcome(client, rid: str, ids: list[int], params: SamplingParams = GREEDY):
    """The tokens of a request, or the EngineFailed it ended with."""
    try:
        tokens, last = await collect(client, rid, ids, params)
    except EngineFailed as exc:
        return exc
    assert last.finish_reason == "length"
    return tokens


async def wait_idle(client, failed_steps: int) -> None:
    """Every slot back, nothing running, and the failure counted (a report from after it)."""
    for _ in range(100):
        stats = client.rank_stats()
        if (stats and stats[0].value("tandem_failed_steps") >= failed_steps
                and stats[0].value("tandem_kv_slots_used") == 0 and stats[0].value("tandem_num_running_reqs") == 0):
            break
        await asyncio.sleep(0.1)
    assert stats[0].value("tandem_failed_steps") == failed_steps
    assert all(stats[0].value(name) == 0 for name in ("tandem_kv_slots_used", "tandem_num_running_reqs",
                                                      "tandem_num_waiting_reqs"))


async def poison_while_others_decode(client, prompts):
    """Start every request but the last, then the poisoned one once the others have output."""
    others = [client.generate(f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts[1:])]
    firsts = [await stream.__anext__() for stream in others]

    async def rest(stream, first):
        tokens = list(first.token_ids)
        try:
            async for delta in stream:
                tokens += delta.token_ids
        except EngineFailed as exc:
            return exc
        return tokens
    poisoned = asyncio.create_task(outcome(client, "poison", prompts[0]))
    results = await asyncio.wait_for(asyncio.gather(*[rest(s, f) for s, f in zip(others, firsts)]), 120)
    return await asyncio.wait_for(poisoned, 120), results


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_a_failing_step_fails_only_its_requests(config, prompts, hf_greedy, monkeypatch):
    monkeypatch.setenv(ENV, "rid=poison")
    async with engine(["--model-path", str(DENSE), *CONFIGS[config]]) as client:
        poisoned, others = await poison_while_others_decode(client, prompts)
        assert isinstance(poisoned, EngineFailed) and "fault injected" in str(poisoned)
        step = str(poisoned).split(":")[0]                           # "step N failed"
        for result, ref in zip(others, hf_greedy[1:]):
            if isinstance(result, EngineFailed):                     # shared the poisoned batch (plain decoding)
                assert config.startswith("none") and str(result).startswith(step)
            else:
                assert result == ref
        if not config.startswith("none"):                            # prefill batches hold no decodes
            assert not any(isinstance(r, EngineFailed) for r in others)
        await wait_idle(client, failed_steps=1)
        again = await asyncio.gather(*[outcome(client, f"again{i}", ids) for i, ids in enumerate(prompts)])
        assert again == hf_greedy                                    # the rank serves on, unchanged


@pytest.mark.parametrize("where", ["deferred", "launch"])
async def test_deferred_and_cpu_side_failures_are_isolated_too(where, prompts, hf_greedy, monkeypatch):
    """deferred: the EAGLE head's read of the poisoned prompt fails after its first token went out;
    the next launch reports it, and the poisoned request (not that launch's) fails."""
    monkeypatch.setenv(ENV, f"rid=poison,where={where}")
    async with engine(["--model-path", str(DENSE), *ALWAYS]) as client:
        poisoned, others = await poison_while_others_decode(client, prompts)
        assert isinstance(poisoned, EngineFailed) and where in str(poisoned)
        assert others == hf_greedy[1:]
        await wait_idle(client, failed_steps=1)
        assert await outcome(client, "after", prompts[0]) == hf_greedy[0]


async def test_a_seeded_request_survives_a_neighbours_failure(prompts, monkeypatch):
    """Sampling with a seed gives the same text whether or not a batch next to it failed."""
    seeded = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=2**63 - 17, ignore_eos=True)
    async with engine(["--model-path", str(DENSE)]) as client:
        clean = await outcome(client, "clean", prompts[1], seeded)
    monkeypatch.setenv(ENV, "rid=poison")
    async with engine(["--model-path", str(DENSE)]) as client:
        stream = client.generate("seeded", prompts[1], seeded)
        first = await stream.__anext__()
        poisoned = await outcome(client, "poison", prompts[0])
        tokens = list(first.token_ids) + [t async for delta in stream for t in delta.token_ids]
    assert isinstance(poisoned, EngineFailed)
    assert tokens == clean


@pytest.mark.parametrize("where", ["stream", "launch"])
@pytest.mark.parametrize("algorithm", [name for name in ALGORITHMS if name != "none"])
async def test_the_step_behind_a_failure_writes_nothing_into_a_neighbours_kv(algorithm, where, prompts):
    """The poisoned request's prefill fails (its work never wrote its slot-table entries nor its
    decode state), while the step behind it, launched with the overlap, already holds its first
    speculative decode. The neighbour was admitted first, so it owns slot 0, where a fresh row's
    unwritten entries point. (Without speculation a prompt shares its step with every decode: the
    neighbour would fail with it, as test_a_failing_step_fails_only_its_requests expects.)"""
    device = CpuDevice()
    core = build_core(parse_args(["--model-path", str(DENSE), *ALGORITHMS[algorithm]]), device, eos_ids=frozenset())
    try:
        scheduler, runner = core.scheduler, core.runner
        # the neighbour must outlive the poisoned prefill: a launch of several n-gram rounds emits dozens of tokens
        long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
        assert scheduler.add("neighbour", prompts[1], long) is None
        neighbour = scheduler.requests["neighbour"]
        for _ in range(100):
            if len(neighbour.output_ids) >= 4:
                break
            await core.step()
        await core.drain()
        slots = torch.tensor(scheduler.pool.slots(neighbour.pages, 0, neighbour.kv_len))
        assert slots[0] == 0
        held = [(k[slots].clone(), v[slots].clone()) for k, v in zip(runner.kv.k, runner.kv.v)]
        runner.faults = FaultInjector(rid="poison", where=where)
        assert scheduler.add("poison", prompts[0], GREEDY) is None
        poison = scheduler.requests["poison"]
        for _ in range(100):
            if poison.finished:
                break
            await core.step()
        await core.drain()
        assert poison.finish_reason == "error" and not neighbour.finished and core.failed_steps == 1
        for (k, v), (k_held, v_held) in zip(zip(runner.kv.k, runner.kv.v), held):
            assert torch.equal(k[slots], k_held) and torch.equal(v[slots], v_held)
    finally:
        device.close()
