"""The scheduler and KV pool on plain data: no tensors, no model.

A fake device "samples" token = (last fed token + 1) % 50, which lets the tests
check what each step fed, including futures resolved one step late (overlap)."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from devices.base import Launched
from engine.core import EngineCore
from engine.kv_pool import KVPool
from engine.messages import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from spec.policy import SpeculativeDecoding


def make(num_slots=4096, page_size=1, rows=16, chunk=64, budget=128, max_running=16):
    pool = KVPool(num_slots, page_size, rows)
    config = SchedulerConfig(max_running_requests=max_running, max_queued_requests=100, max_prefill_tokens=budget,
                             chunked_prefill_size=chunk, context_length=4096, future_slots=2 * rows + 2)
    return Scheduler(config, pool, eos_ids=frozenset({49}))


class FakeDevice:
    """Resolves futures and 'samples' deterministically, remembering what each sequence saw."""

    def __init__(self):
        self.futures = {}
        self.table = {}       # (row, position) -> slot

    def run(self, batch):
        tokens, offset = [], 0
        for seq in batch.seqs:
            if batch.is_spec_decode:          # no input ids: the device knows (tests run these without overlap)
                fed = [seq.req.all_ids[-1]]
            else:
                fed = [self.futures[-t] if t < 0 else t for t in batch.input_ids[offset:offset + seq.q_len]]
                offset += seq.q_len
            if seq.samples:
                tokens.append((fed[-1] + 1) % 50 if fed[-1] != 48 else 0)
                self.futures[seq.future_id] = tokens[-1]
        for row, pos, slot in zip(batch.table_rows, batch.table_pos, batch.table_slots):
            self.table[row, pos] = slot
        return StepOutput(tokens=[[t] for t in tokens])


def expected(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % 50 if last != 48 else 0
        out.append(last)
    return out


class FakeRunner:
    """The engine core's runner over FakeDevice: a launch is done at once."""

    def __init__(self):
        self.device = FakeDevice()

    def graph_shape(self, batch):
        return None                      # no graphs: every step runs "eagerly"

    def launch(self, batch, graph=None):
        future = asyncio.get_running_loop().create_future()
        out = self.device.run(batch)
        future.set_result(SimpleNamespace(output=lambda: out, rounds=None))
        return Launched(future)


def drive(sched, overlap=True, max_steps=2000, on_step=None):
    """Run the scheduler as the rank does: through the engine core, with or without overlap."""
    core = EngineCore(sched, FakeRunner(), overlap)

    async def run():
        for _ in range(max_steps):
            if not core.busy:
                return
            await core.step()
            if on_step:
                on_step(sched)
        raise AssertionError("the engine core did not finish")
    asyncio.run(run())
    return core.runner.device


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_are_exact_and_everything_is_freed(overlap, page_size):
    sched = make(page_size=page_size)
    rng = random.Random(0)
    reqs = {}
    for i in range(12):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 150))]
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 30), ignore_eos=True))
        reqs[f"r{i}"] = (sched.requests[f"r{i}"], prompt)
    drive(sched, overlap)
    for req, prompt in reqs.values():
        assert req.finished and req.finish_reason == "length"
        assert req.output_ids == expected(prompt, req.params.max_new_tokens)
    assert sched.pool.used_slots == 0 and len(sched.pool.free_rows) == 16


def test_chunked_prefill_respects_budget_and_shares_steps_with_decodes():
    sched = make(chunk=32, budget=48)
    sched.add("short", [1, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    sched.add("long", list(range(1, 41)) * 3, SamplingParams(max_new_tokens=2, ignore_eos=True))
    device = FakeDevice()
    b1 = sched.schedule()
    assert [s.q_len for s in b1.seqs] == [3, 32]            # whole short prompt, first chunk of long
    sched.process(b1, device.run(b1))
    b2 = sched.schedule()
    assert [s.q_len for s in b2.seqs] == [1, 32]            # a decode rides along the next chunk
    assert sum(s.q_len for s in b2.seqs if s.q_len > 1) <= 48
    assert not b2.seqs[1].samples                           # a middle chunk samples nothing


def test_eos_and_stop_ids():
    sched = make()
    sched.add("a", [46], SamplingParams(max_new_tokens=50))
    req_a = sched.requests["a"]
    sched.add("b", [46], SamplingParams(max_new_tokens=50, stop_token_ids=(48,)))
    req_b = sched.requests["b"]
    sched.add("c", [46], SamplingParams(max_new_tokens=5, ignore_eos=True))
    req_c = sched.requests["c"]
    drive(sched, overlap=True)
    # 46 -> 47 -> 48 -> 0 ... (this fake never emits 49, the eos), so "a" runs to its limit
    assert req_a.output_ids == expected([46], 50) and req_a.finish_reason == "length"
    assert req_b.output_ids == [47, 48] and req_b.finish_reason == "stop" and req_b.matched_stop == 48
    assert req_c.output_ids == expected([46], 5)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_kv_pressure_recomputes_exactly(overlap):
    sched = make(num_slots=96, chunk=32, budget=64, rows=8, max_running=8)
    rng = random.Random(1)
    reqs = []
    for i in range(8):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(5, 30))]
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        reqs.append((sched.requests[f"r{i}"], prompt))
    used = []
    drive(sched, overlap, on_step=lambda s: used.append(s.pool.used_slots))
    assert sched.retractions > 0
    assert max(used) <= 96
    for req, prompt in reqs:
        assert req.output_ids == expected(prompt, 30)
    assert sched.pool.used_slots == 0


def test_abort_frees_once_even_while_in_flight():
    sched = make()
    sched.add("a", list(range(1, 20)), SamplingParams(max_new_tokens=100, ignore_eos=True))
    device = FakeDevice()
    b1 = sched.schedule()
    out1 = device.run(b1)
    b2 = sched.schedule()                      # "a" is in two batches now
    out2 = device.run(b2)
    assert sched.abort("a", "abort") is not None
    assert sched.abort("a", "abort") is None   # second abort is a no-op
    assert sched.pool.used_slots == 0
    assert sched.process(b1, out1) == [] and sched.process(b2, out2) == []
    assert sched.pool.used_slots == 0 and not sched.has_work


def test_rejects_what_can_never_run():
    sched = make(num_slots=64)
    assert "empty" in sched.add("a", [], SamplingParams())
    assert "KV cache" in sched.add("b", [1] * 10, SamplingParams(max_new_tokens=100))
    assert sched.add("c", [1] * 10, SamplingParams(max_new_tokens=10)) is None
    assert "duplicate" in sched.add("c", [1], SamplingParams())


def test_under_load_decodes_go_plain_once_no_drafting_step_is_in_flight():
    """Speculation (k=3) off from 2 decoding requests. The rank keeps one batch in flight, so a
    prefill batch always lies between a drafting step and the load its prompt brings; with two
    batches unprocessed here, load finds r0's drafting step in flight: that step drafts nothing
    (r0's kv_len is only a bound), the next one decodes plain, reading r0's future, with r2's prompt."""
    config = SchedulerConfig(max_running_requests=8, max_queued_requests=100, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=4096, future_slots=18)
    spec = SpeculativeDecoding(spec_tokens=4, off_batch_size=2, draft_catches_up=True)
    sched = Scheduler(config, KVPool(4096, 1, 8), eos_ids=frozenset(), policy=spec)
    params = SamplingParams(max_new_tokens=40, temperature=0)
    sched.add("r0", [1, 2, 3, 4, 5], params)
    prefill = sched.schedule()
    sched.process(prefill, StepOutput(tokens=[[6]]))
    drafting = sched.schedule()
    assert drafting.is_spec_decode and drafting.chain == 3 and sched.requests["r0"].decode.drafting == 1
    sched.add("r1", [7, 8, 9], params)
    prefill_r1 = sched.schedule()                  # r0 waits: a prompt is ready and load has not arrived
    assert not prefill_r1.is_spec_decode and [s.req.rid for s in prefill_r1.seqs] == ["r1"]
    chain0 = sched.schedule()                      # under load, r0's drafting step still in flight
    assert chain0.is_spec_decode and chain0.chain == 0 and spec.off_steps == 1
    r0_future = sched.requests["r0"].future_id
    sched.process(drafting, StepOutput(tokens=[[6, 7, 8]]))       # 2 of 3 drafts accepted
    sched.process(prefill_r1, StepOutput(tokens=[[10]]))
    sched.add("r2", [11, 12], params)
    plain = sched.schedule()
    assert not plain.is_spec_decode and spec.off_steps == 2
    assert [(s.req.rid, s.q_len) for s in plain.seqs] == [("r0", 1), ("r1", 1), ("r2", 2)]
    assert plain.input_ids[0] == -r0_future            # the token chain0 emits, not yet on the host
    r0 = sched.requests["r0"]
    assert plain.seqs[0].start == len(r0.all_ids) == 9         # exact (5 prompt + 4 outputs on the host)
    # The device's L was 8 after the drafting step: its draft holds positions < 7; it skips the
    # chain-0 step and this one (a draft model that catches up: standalone), so it lags 2.
    assert plain.spec.draft_skip and (r0.decode.draft_end, r0.decode.draft_lag) == (7, 2)
    sched.process(chain0, StepOutput(tokens=[[9], [11]]))
    sched.process(plain, StepOutput(tokens=[[10], [12], [13]]))
    assert r0.output_ids == [6, 6, 7, 8, 9, 10] and r0.decode.verify_steps == 3     # a plain decode counts as a verify
    assert sched.requests["r2"].decode.verify_steps == 0                             # its first token is the prefill's


@pytest.mark.parametrize("off_at", [0, 3], ids=["drafting", "plain-under-load"])
def test_speculation_with_a_full_cache_keeps_making_progress(off_at):
    """Speculative decode steps and chunked prompts compete for a cache that fits only some of them:
    a prompt whose next chunk cannot fit must not hold the decodes back (they free pages as they
    finish), and prompts that all stall get retracted. Every step here accepts no draft."""
    sched = make(num_slots=200, chunk=16, budget=32, rows=8, max_running=8)
    sched.policy = SpeculativeDecoding(spec_tokens=4, off_batch_size=off_at)
    rng = random.Random(2)
    reqs = []
    for i in range(8):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(30, 50))]
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        reqs.append((sched.requests[f"r{i}"], prompt))
    drive(sched, overlap=False, max_steps=3000)
    assert sched.retractions > 0
    for req, prompt in reqs:
        assert req.output_ids == expected(prompt, 30)
    assert sched.pool.used_slots == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_prompts_that_fill_the_cache_half_prefilled_are_retracted_not_stalled(overlap):
    """Two chunked prompts that each fit the cache alone, admitted together, fill it half-way each:
    neither can grow, nothing decodes; the newest goes back to wait, and both finish."""
    sched = make(num_slots=64, chunk=16, budget=64, rows=4, max_running=4)
    prompts = [[1 + i % 40 for i in range(60)], [2 + i % 40 for i in range(60)]]
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    reqs = [sched.requests["r0"], sched.requests["r1"]]
    drive(sched, overlap=overlap, max_steps=500)
    assert sched.retractions > 0
    assert [r.output_ids for r in reqs] == [expected(p, 4) for p in prompts]
