"""Multi-step decoding (--num-scheduler-steps): several decode steps a launch give the outputs of
one step a launch, and the scheduler around them keeps its contracts; for plain decoding, and for
speculative decoding (several draft/verify rounds a launch).

On plain data (the scheduler tests' fake device, which runs a multi-step batch's steps itself):
exact outputs with and without overlap, EOS and stop ids inside a run, retraction under KV
pressure, the context limit, a new prompt not waiting behind more than the launch in flight,
everything freed. On the embedded model, in-process: greedy, seeded sampling and logprobs equal
to plain decoding for requests of different lengths and limits side by side; every speculative
algorithm's rounds equal its one-step launches (and its greedy, plain greedy decoding)."""
from __future__ import annotations

import random

import pytest

from engine.kv_pool import KVPool
from engine.launch_budget import LaunchBudget
from engine.messages import SamplingParams
from engine.multi_step import MultiStepDecoding
from engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from spec.policy import SpeculativeDecoding
from tests.test_scheduler import FakeDevice, drive, expected


class MultiStepDevice(FakeDevice):
    """FakeDevice that runs a multi-step batch's steps, each row feeding its own last token, and
    checks that every position a step writes has its slot-table entry."""

    def __init__(self):
        super().__init__()
        self.multi_batches = 0
        self.batches = 0

    def run(self, batch):
        self.batches += 1
        if batch.steps == 1:
            return super().run(batch)
        self.multi_batches += 1
        for row, pos, slot in zip(batch.table_rows, batch.table_pos, batch.table_slots):
            self.table[row, pos] = slot
        runs = []
        for seq, fed in zip(batch.seqs, batch.input_ids):
            assert seq.q_len == 1 and seq.decode
            last, run = self.futures[-fed] if fed < 0 else fed, []
            for pos in range(seq.start, seq.start + batch.steps):
                assert (seq.row, pos) in self.table, "a step writes a position without a slot"
                last = (last + 1) % 50 if last != 48 else 0
                run.append(last)
            self.futures[seq.future_id] = last
            runs.append(run)
        return StepOutput(tokens=runs)


def make(steps=4, num_slots=4096, rows=16, chunk=64, budget=128, context=4096, page_size=1):
    config = SchedulerConfig(max_running_requests=rows, max_queued_requests=100, max_prefill_tokens=budget,
                             chunked_prefill_size=chunk, context_length=context, future_slots=2 * rows + 2)
    return Scheduler(config, KVPool(num_slots, page_size, rows), eos_ids=frozenset({49}),
                     policy=MultiStepDecoding(steps))


def drive_multi(sched, overlap=True, on_step=None):
    import tests.test_scheduler as plain
    original, plain.FakeDevice = plain.FakeDevice, MultiStepDevice
    try:
        return drive(sched, overlap, on_step=on_step)
    finally:
        plain.FakeDevice = original


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_are_exact_and_everything_is_freed(overlap, page_size):
    sched = make(page_size=page_size)
    rng = random.Random(0)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 150))]
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 30), ignore_eos=True))
        reqs.append((sched.requests[f"r{i}"], prompt))
    device = drive_multi(sched, overlap)
    assert device.multi_batches > 0
    for req, prompt in reqs:
        assert req.finish_reason == "length" and req.output_ids == expected(prompt, req.params.max_new_tokens)
    assert sched.pool.used_slots == 0 and len(sched.pool.free_rows) == 16


def test_stop_ids_and_limits_inside_runs_give_plain_outputs():
    sched = make(steps=8)
    params = {"stop": SamplingParams(max_new_tokens=50, stop_token_ids=(45,)),
              "limit": SamplingParams(max_new_tokens=11, ignore_eos=True),
              "long": SamplingParams(max_new_tokens=40, ignore_eos=True)}
    for rid, p in params.items():
        sched.add(rid, [40], p)
    reqs = {rid: sched.requests[rid] for rid in params}
    drive_multi(sched)
    assert reqs["stop"].output_ids == [41, 42, 43, 44, 45] and reqs["stop"].matched_stop == 45
    assert reqs["limit"].output_ids == expected([40], 11)
    assert reqs["long"].output_ids == expected([40], 40)


def test_no_run_goes_past_what_requests_can_use():
    """Each multi-step batch runs no more steps than its requests can still emit (max_tokens), nor
    past a request's context (its KV positions must exist)."""
    sched = make(steps=8, context=40)
    sched.add("long", [1, 2, 3], SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.add("near-context", list(range(1, 35)), SamplingParams(max_new_tokens=100, ignore_eos=True))
    reqs = dict(sched.requests)
    seen = []
    device = MultiStepDevice()
    while sched.has_work:
        batch = sched.schedule()
        if batch.steps > 1:
            seen.append(batch.steps)
            assert all(seq.start + batch.steps <= 40 for seq in batch.seqs)
        sched.process(batch, device.run(batch))
    assert seen and max(seen) <= 8 and min(seen) < 8
    assert reqs["long"].output_ids == expected([1, 2, 3], 30)
    assert reqs["near-context"].finish_reason == "length" and len(reqs["near-context"].all_ids) == 40
    assert sched.pool.used_slots == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_lone_request_takes_one_launch_per_run(overlap):
    """100 tokens at 8 a launch: the prefill's, twelve runs of eight, one of three, and no other
    launch (with overlap, a batch planned on the one in flight counts its tokens)."""
    sched = make(steps=8)
    sched.add("a", [1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True))
    req = sched.requests["a"]
    device = drive_multi(sched, overlap)
    assert req.output_ids == expected([1, 2, 3], 100)
    assert device.multi_batches == 13 and device.batches == 14


def test_a_new_prompt_waits_only_for_the_launch_in_flight():
    sched = make(steps=8)
    sched.add("a", [1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True))
    device = MultiStepDevice()
    prefill = sched.schedule()
    sched.process(prefill, device.run(prefill))
    in_flight = sched.schedule()
    assert in_flight.steps == 8
    sched.add("b", [5, 6, 7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True))
    mixed = sched.schedule()                     # planned while the multi-step batch is in flight
    assert mixed.steps == 1 and [(s.req.rid, s.q_len) for s in mixed.seqs] == [("a", 1), ("b", 4)]
    assert mixed.seqs[0].start == 3 + 8          # the prompt, then the eight positions in flight
    sched.process(in_flight, device.run(in_flight))
    sched.process(mixed, device.run(mixed))
    assert sched.requests["a"].output_ids == expected([1, 2, 3], 10)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_kv_pressure_recomputes_exactly(overlap):
    sched = make(steps=4, num_slots=96, chunk=32, budget=64, rows=8)
    rng = random.Random(1)
    reqs = []
    for i in range(8):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(5, 30))]
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        reqs.append((sched.requests[f"r{i}"], prompt))
    used = []
    drive_multi(sched, overlap, on_step=lambda s: used.append(s.pool.used_slots))
    assert sched.retractions > 0 and max(used) <= 96
    for req, prompt in reqs:
        assert req.output_ids == expected(prompt, 30)
    assert sched.pool.used_slots == 0


# ---- speculative rounds, on plain data ---------------------------------------------------

class RoundsDevice(FakeDevice):
    """FakeDevice for speculative batches (run without overlap: the device reads each request's last
    token on the host): each round accepts a random number of the chain's drafts, every position a
    round may write must have its slot-table entry."""

    def __init__(self, seed: int, table_width: int):
        super().__init__()
        self.rng = random.Random(seed)
        self.table_width = table_width          # the runner's: the context and two steps of k+1
        self.rounds = []

    def run(self, batch):
        assert all(pos < self.table_width for pos in batch.table_pos), "a slot past the slot table"
        if not batch.is_spec_decode:
            return super().run(batch)
        for row, pos, slot in zip(batch.table_rows, batch.table_pos, batch.table_slots):
            self.table[row, pos] = slot
        outputs = []
        for _ in range(batch.steps):
            self.rounds.append(batch.steps)
            runs = []
            for i, seq in enumerate(batch.seqs):
                last = outputs[-1].tokens[i][-1] if outputs else seq.req.all_ids[-1]
                kv_len = len(seq.req.all_ids) - 1 + sum(len(out.tokens[i]) for out in outputs)
                for pos in range(kv_len, kv_len + batch.chain + 1):
                    assert (seq.row, pos) in self.table, "a round writes a position without a slot"
                    assert pos < self.table_width, "a round writes past the slot table"
                run = []
                for _ in range(1 + self.rng.randrange(batch.chain + 1)):
                    last = (last + 1) % 50 if last != 48 else 0
                    run.append(last)
                runs.append(run)
            outputs.append(StepOutput(tokens=runs))
        return StepOutput.joined(outputs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_rounds_give_back_what_they_do_not_accept(seed):
    """Rounds accept at random; requests end inside launches (max_tokens, EOS); the KV bound comes
    back to the exact length and everything is freed; each request counts its rounds as verify steps."""
    import tests.test_scheduler as plain
    config = SchedulerConfig(max_running_requests=8, max_queued_requests=100, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=300, future_slots=18)
    sched = Scheduler(config, KVPool(4096, 4, 8), eos_ids=frozenset({49}),
                      policy=SpeculativeDecoding(spec_tokens=4, rounds=4))
    rng = random.Random(seed)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(5, 120))]
        ignore_eos = i % 2 == 0
        sched.add(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(2, 200), temperature=0,
                                                  ignore_eos=ignore_eos))
        reqs.append((sched.requests[f"r{i}"], prompt, ignore_eos))
    long_prompt = [1 + i % 40 for i in range(281)]            # ends at the context, 19 tokens in
    sched.add("long", long_prompt, SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))
    reqs.append((sched.requests["long"], long_prompt, True))
    original, plain.FakeDevice = plain.FakeDevice, lambda: RoundsDevice(seed, 300 + 2 * 4 + 1)
    try:
        device = drive(sched, overlap=False, max_steps=3000)
    finally:
        plain.FakeDevice = original
    assert max(device.rounds) > 1
    for req, prompt, ignore_eos in reqs:
        want = expected(prompt, req.params.max_new_tokens)
        if not ignore_eos and 49 in want:
            want = want[:want.index(49) + 1]
        want = want[:config.context_length - len(prompt)]
        assert req.output_ids == want
        assert req.decode.extra_rounds == 0 and req.decode.drafting == 0
    assert reqs[-1][0].finish_reason == "length" and len(reqs[-1][0].output_ids) == 19
    assert sched.pool.used_slots == 0 and len(sched.pool.free_rows) == 8


class EveryDraftAccepted:
    def randrange(self, n: int) -> int:
        return n - 1


def test_a_launch_runs_the_rounds_a_request_is_likely_to_use():
    """Every draft accepted (five tokens a round): after a launch of eight rounds, 19 tokens are
    left, and the next launch runs the four rounds they likely take, not eight (the rounds after
    a request's end would only hold up the batch behind)."""
    config = SchedulerConfig(max_running_requests=4, max_queued_requests=10, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=300, future_slots=10)
    sched = Scheduler(config, KVPool(1024, 1, 4), eos_ids=frozenset({49}),
                      policy=SpeculativeDecoding(spec_tokens=5, rounds=8))
    sched.add("a", [1, 2, 3], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))
    req, device, rounds = sched.requests["a"], RoundsDevice(0, 300 + 2 * 5 * 8 + 1), []
    device.rng = EveryDraftAccepted()
    while sched.has_work:
        batch = sched.schedule()
        if batch.is_spec_decode:
            rounds.append(batch.steps)
        sched.process(batch, device.run(batch))
    assert rounds == [8, 4]
    assert req.output_ids == expected([1, 2, 3], 60)


def test_a_launch_ends_where_its_first_request_likely_ends():
    """Every draft accepted (five tokens a round), two requests decoding together: after the first
    launch of eight rounds, one has 5 tokens left and the other 45. The next launch runs the one
    round the first needs, not the eight the second may (the first's row would be verified for
    nothing in seven of them); then the second runs on alone."""
    config = SchedulerConfig(max_running_requests=4, max_queued_requests=10, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=300, future_slots=10)
    sched = Scheduler(config, KVPool(1024, 1, 4), eos_ids=frozenset({49}),
                      policy=SpeculativeDecoding(spec_tokens=5, rounds=8))
    sched.add("short", [1, 2, 3], SamplingParams(max_new_tokens=46, temperature=0, ignore_eos=True))
    sched.add("long", [4, 5, 6], SamplingParams(max_new_tokens=86, temperature=0, ignore_eos=True))
    short, long = sched.requests["short"], sched.requests["long"]
    device, rounds = RoundsDevice(0, 300 + 2 * 5 * 8 + 1), []
    device.rng = EveryDraftAccepted()
    while sched.has_work:
        batch = sched.schedule()
        if batch.is_spec_decode:
            rounds.append((len(batch.seqs), batch.steps))
        sched.process(batch, device.run(batch))
    assert rounds == [(2, 8), (2, 1), (1, 8)]
    assert short.output_ids == expected([1, 2, 3], 46) and long.output_ids == expected([4, 5, 6], 86)
    assert sched.pool.used_slots == 0


def test_the_launch_budget_learns_steps_per_size():
    ms = 1e-3
    budget = LaunchBudget(20 * ms)
    assert budget.steps(1) == 1                              # nothing measured: one step, which measures it
    budget.observe(rows=2, chain=0, steps=1, seconds=300 * ms)     # a slow first launch ...
    assert budget.steps(2) == 1
    budget.observe(rows=2, chain=0, steps=4, seconds=8 * ms)
    budget.observe(rows=2, chain=0, steps=8, seconds=16 * ms)
    assert budget.steps(2) == 10                             # ... is outvoted: 2 ms a step
    assert budget.steps(1) == 10                             # a smaller size: the nearest larger one's time
    assert budget.steps(8) == 2                              # a larger one: scaled up, 8 ms a step
    budget.observe(rows=8, chain=0, steps=2, seconds=10 * ms)
    assert budget.steps(8) == 4 and budget.steps(5) == 4
    assert budget.steps(2, chain=4) == 1                     # speculative steps are measured apart
    assert LaunchBudget(0).steps(64) > 1000                  # 0: no cap


def test_launches_run_the_steps_that_fit_the_budget():
    """A lone request: one-step launches until a step is measured, then what fits in 10 ms at
    the measured 2.5 ms a step (four), whatever --num-scheduler-steps allows beyond."""
    sched = make(steps=16)
    sched.policy.budget = LaunchBudget(10e-3)
    sched.add("a", [1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    req, device, seen = sched.requests["a"], MultiStepDevice(), []
    while sched.has_work:
        batch = sched.schedule()
        seen.append(batch.steps)
        sched.process(batch, device.run(batch))
        sched.policy.observe_launch(batch, 2.5e-3 * batch.steps, batch.steps)
    assert seen == [1, 1] + [4] * 9 + [2]       # the prefill's token, one step measured, 38 more
    assert req.output_ids == expected([1, 2, 3], 40)


def test_speculative_rounds_fit_the_budget():
    """Rounds of a draft/verify step measured at 4 ms: two fit in 10 ms, of the eight allowed."""
    config = SchedulerConfig(max_running_requests=4, max_queued_requests=10, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=300, future_slots=10)
    sched = Scheduler(config, KVPool(1024, 1, 4), eos_ids=frozenset({49}),
                      policy=SpeculativeDecoding(spec_tokens=4, rounds=8, budget=LaunchBudget(10e-3)))
    sched.add("a", [1, 2, 3], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))
    req, device, rounds = sched.requests["a"], RoundsDevice(0, 300 + 2 * 4 * 8 + 1), []
    while sched.has_work:
        batch = sched.schedule()
        if batch.is_spec_decode:
            rounds.append(batch.steps)
        sched.process(batch, device.run(batch))
        sched.policy.observe_launch(batch, 4e-3 * batch.steps, batch.steps)
    assert rounds[0] == 1 and max(rounds) == 2 and rounds.count(2) >= len(rounds) - 3
    assert req.output_ids == expected([1, 2, 3], 60)


# ---- the embedded model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    from tests.e2e_prompts import CODE_PROMPTS
    from tests.server_harness import DENSE
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(p) for p in CODE_PROMPTS[:4]]


def scheduler_steps(flags: list[str]) -> int:
    """Steps a launch may run with these flags (on the CPU: 16 when not given)."""
    return int(flags[flags.index("--num-scheduler-steps") + 1]) if "--num-scheduler-steps" in flags else 16


ONE_STEP = ["--num-scheduler-steps", "1"]
FOUR_STEPS = ["--num-scheduler-steps", "4", "--max-launch-ms", "0"]       # four whatever a step takes


async def outputs(flags: list[str], prompts: list[list[int]], params: list[SamplingParams], algorithm: str = "none"):
    from tests.server_harness import DENSE
    from tests.test_engine_core import Engine
    engine = Engine(["--model-path", str(DENSE), "--speculative-algorithm", algorithm, "--max-total-tokens", "4096",
                     "--max-running-requests", "4"] + flags)
    try:
        reqs = [engine.add(f"r{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        steps = []
        engine.core.launch_observers.append(lambda flight: steps.append(flight.batch.steps))
        await engine.finish()
        assert (max(steps) > 1) == (scheduler_steps(flags) > 1)
        assert engine.core.scheduler.pool.used_slots == 0
        return [(r.output_ids, r.output_logprobs, r.output_top_logprobs, r.finish_reason) for r in reqs]
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [[], ["--disable-overlap-schedule"]], ids=["overlap", "serial"])
async def test_the_embedded_model_decodes_as_plain_decoding(overlap, prompts):
    """Greedy, seeded sampling with top-p, logprobs, and limits that end inside a run."""
    params = [SamplingParams(max_new_tokens=37, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=26, temperature=0.7, seed=2**40 + 1, ignore_eos=True, logprobs=0)]
    plain = await outputs(overlap + ONE_STEP, prompts, params)
    multi = await outputs(overlap + FOUR_STEPS, prompts, params)
    assert multi == plain
    assert await outputs(overlap, prompts, params) == plain        # the CPU's default: 16 steps within 20 ms
    greedy_stop = plain[0][0][9]            # a stop id the greedy row meets: its run is cut there
    params[0] = SamplingParams(max_new_tokens=37, temperature=0, stop_token_ids=(greedy_stop,))
    cut = await outputs(overlap + FOUR_STEPS, prompts, params)
    stop_at = plain[0][0].index(greedy_stop)
    assert cut[0][0] == plain[0][0][:stop_at + 1] and cut[0][3] == "stop"


@pytest.mark.parametrize("algorithm,flags", [("eagle", []), ("ngram", []), ("standalone", []),
                                             ("eagle", ["--enable-cpu-graph"])],
                         ids=["eagle", "ngram", "standalone", "eagle-graphs"])
async def test_speculative_rounds_decode_as_one_step_launches(algorithm, flags, prompts):
    """Greedy (with logprobs, and a limit inside a launch) and seeded sampling: the same outputs with
    four rounds a launch as with one; the greedy rows are plain greedy decoding's. With graphs the
    rounds' verify runs eagerly and their drafts replay captured steps of a wider key."""
    params = [SamplingParams(max_new_tokens=37, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=26, temperature=0.7, seed=2**40 + 1, ignore_eos=True, logprobs=0)]
    one = await outputs(flags + ONE_STEP, prompts, params, algorithm)
    rounds = await outputs(flags + FOUR_STEPS, prompts, params, algorithm)
    assert rounds == one
    greedy = [SamplingParams(max_new_tokens=p.max_new_tokens, temperature=0, ignore_eos=True) for p in params]
    plain = await outputs(ONE_STEP, prompts, greedy)
    assert [o[0] for o in await outputs(flags + FOUR_STEPS, prompts, greedy, algorithm)] == \
        [o[0] for o in plain]


@pytest.mark.parametrize("algorithm", ["eagle", "ngram"])
async def test_a_launch_stops_its_rounds_once_its_requests_have_every_token(algorithm, prompts):
    """Eight rounds a launch, one greedy request at a time (no overlap: each launch is planned on
    the one before it, processed): on the CPU the device ends a launch's rounds once the request has
    all its tokens, so every round that runs emits tokens it keeps, and its verify steps (the accept
    length's divisor, and what rounds_likely plans from) count only those rounds."""
    from tests.server_harness import DENSE
    from tests.test_engine_core import Engine
    engine = Engine(["--model-path", str(DENSE), "--speculative-algorithm", algorithm, "--max-total-tokens", "4096",
                     "--num-scheduler-steps", "8", "--max-launch-ms", "0", "--disable-overlap-schedule"])
    try:
        launched, ran, kept, early = [], [], [], 0
        engine.core.observers.append(lambda done: done.batch.is_spec_decode and (
            launched.append(done.batch.steps), ran.append(len(done.result.rounds or [None])),
            kept.extend(done.output.rounds[0] if done.output.rounds else [len(done.output.tokens[0])])))
        for i, limit in enumerate((12, 30)):
            req = engine.add(f"r{i}", prompts[i], SamplingParams(max_new_tokens=limit, temperature=0, ignore_eos=True))
            await engine.finish()
            assert len(req.output_ids) == limit
            assert req.decode.verify_steps == len(kept) and sum(kept) >= limit - 1
            assert sum(kept[:-1]) < limit - 1                 # every round began with tokens still to emit
            early += sum(r < n for r, n in zip(ran, launched))
            launched.clear(), ran.clear(), kept.clear()
        assert early                                          # a launch ended before its last round
    finally:
        engine.close()


@pytest.mark.parametrize("algorithm", ["eagle", "ngram"])
async def test_a_launch_planned_past_its_requests_end_runs_no_round(algorithm, prompts):
    """With overlap, one greedy request at a time: the launch after a request's last is planned while
    that one runs, before the host knows the request ends there. On the CPU the device sees every
    row ended and runs none of its rounds (before, its first round always ran: a draft and a verify
    of nothing kept); the request's tokens are plain decoding's, and the next request is unharmed."""
    from tests.server_harness import DENSE
    from tests.test_engine_core import Engine
    engine = Engine(["--model-path", str(DENSE), "--speculative-algorithm", algorithm, "--max-total-tokens", "4096",
                     "--num-scheduler-steps", "8", "--max-launch-ms", "0"])
    params = [SamplingParams(max_new_tokens=limit, temperature=0, ignore_eos=True) for limit in (12, 30)]
    try:
        ran = []
        engine.core.observers.append(lambda done: done.batch.is_spec_decode and ran.append(
            len(done.result.rounds) if done.result.rounds is not None else None))
        reqs = []
        for i, p in enumerate(params):
            reqs.append(engine.add(f"r{i}", prompts[i], p))
            await engine.finish()
        assert 0 in ran                                       # a launch past a request's end ran no round
        assert engine.core.scheduler.pool.used_slots == 0
    finally:
        engine.close()
    plain = await outputs(ONE_STEP, prompts[:2], params)
    assert [r.output_ids for r in reqs] == [o[0] for o in plain]


@pytest.mark.parametrize("algorithm", ["eagle", "ngram"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
async def test_a_greedy_launch_of_rounds_yields_to_a_prompt_that_arrives(algorithm, greedy, prompts):
    """A prompt that arrives while a launch of eight speculative rounds is planned or runs would wait for
    all eight (speculative decodes never share a launch with prompt chunks). An all-greedy launch starts
    no round after the first once one has arrived (spec/arrivals.py); the outputs stay plain greedy
    decoding's and everything is freed. A seeded request's launch runs all its rounds: round i samples
    with its i-th step's noise key, so its outputs are those of a run where nothing arrives."""
    from tests.server_harness import DENSE
    from tests.test_engine_core import Engine
    flags = ["--model-path", str(DENSE), "--speculative-algorithm", algorithm, "--max-total-tokens", "4096",
             "--num-scheduler-steps", "8", "--max-launch-ms", "0", "--speculative-adaptive", "off"]
    first = SamplingParams(max_new_tokens=40, ignore_eos=True,
                           **({"temperature": 0} if greedy else {"temperature": 0.8, "seed": 5}))
    second = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(flags)
    try:
        reqs, arrived_during, ran = [], [], []

        def arrive(flight) -> None:      # right after the first launch of eight rounds is on the stream
            if flight.batch.is_spec_decode and flight.batch.steps == 8 and len(reqs) == 1:
                arrived_during.append(flight.batch)
                reqs.append(engine.add("r1", prompts[1], second))
        engine.core.launch_observers.append(arrive)
        engine.core.observers.append(
            lambda done: done.batch in arrived_during and ran.append(len(done.result.rounds)))
        reqs.append(engine.add("r0", prompts[0], first))
        await engine.finish()
        assert len(reqs) == 2 and engine.core.scheduler.pool.used_slots == 0
        assert (ran[0] < 8) == greedy                  # rounds cut short only where every row is greedy
    finally:
        engine.close()
    reference = await outputs(ONE_STEP, prompts[:2], [first, second], "none" if greedy else algorithm)
    assert [r.output_ids for r in reqs] == [o[0] for o in reference]
