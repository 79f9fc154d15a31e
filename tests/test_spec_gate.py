"""Speculation that pays or steps aside (spec/gate.py, --speculative-adaptive).

- The gate's decisions on plain numbers (no timing): speculation first, then plain to measure it,
  then whichever is expected to be faster per token; hysteresis; runs of launches in
  the other mode, so that a rise in acceptance turns speculation back on; buckets apart.
- The policy on plain data: greedy batches the gate sends plain decode in runs (or one token each
  beside prompt chunks), through a chain-0 step while a drafting step is in flight; sampling
  batches keep speculating; the fixed --speculative-disable-by-batch-size rule comes first.
- A fake device that keeps each row's state as a worker does, with a gate that switches every
  few launches: every plain decode starts at the row's exact length, every draft has read what
  its lag says, outputs are exact and everything is freed (overlap on and off, runs of steps).
- On the embedded model, in-process: greedy outputs are plain greedy decoding's with the gate
  switching every launch or two (EAGLE, EAGLE-3, n-gram, standalone; overlap on and off; one
  step and four a launch), EAGLE accepts as much after plain runs as without them, the real
  gate runs both modes; /metrics shows the gate's counters and estimates.
"""
from __future__ import annotations

import random

import pytest

from engine.batch import StepOutput
from engine.kv_pool import KVPool
from engine.messages import RankStats, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from spec.gate import (EXPLORE_COST, EXPLORE_EVERY, EXPLORE_MAX, EXPLORE_RUN, LEAVE, RETURN, WARM, WINDOW, Estimate,
                       SpecGate, bucket_label, bucket_of)
from spec.policy import SpeculativeDecoding
from spec.stats import SpecStats
from tests.test_scheduler import drive, expected

GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


# ---- the gate's decisions ----------------------------------------------------------------

def spec_launch(gate: SpecGate, rows: int, ms_per_round: float, tokens_per_round: float, rounds: int = 4) -> None:
    gate.observe(rows, True, ms_per_round * rounds / 1000, rounds, round(tokens_per_round * rounds * rows))


def plain_launch(gate: SpecGate, rows: int, ms_per_step: float, steps: int = 4) -> None:
    gate.observe(rows, False, ms_per_step * steps / 1000, steps)


def feed(gate: SpecGate, rows: int, launches: int) -> list[bool]:
    """Ask and feed `launches` launches; the modes they ran."""
    modes = []
    for _ in range(launches):
        modes.append(gate.speculate(rows))
        gate.fed(rows, modes[-1])
    return modes


def test_buckets_are_powers_of_two():
    assert [bucket_label(i) for i in range(6)] == ["1", "2-3", "4-7", "8-15", "16-31", "32+"]
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_each_mode_is_measured_first_speculation_first_then_the_faster_wins():
    gate = SpecGate()
    for _ in range(WARM):
        assert gate.speculate(1)                     # nothing measured: speculation first
        spec_launch(gate, 1, ms_per_round=2.5, tokens_per_round=2.0)    # 800 tok/s
    for _ in range(WARM):
        assert not gate.speculate(1)                 # then plain, to measure it
        plain_launch(gate, 1, ms_per_step=1.0)       # 1000 tok/s: speculation loses
    assert not gate.speculate(1) and not gate.speculate(1)
    assert gate.speculate(4)                         # another bucket measures for itself
    [estimate] = gate.estimates()
    assert (estimate.label, estimate.speculating) == ("1", False)
    assert estimate.spec_tokens_per_s == pytest.approx(800) and estimate.plain_tokens_per_s == pytest.approx(1000)


def warm(gate: SpecGate, rows: int, spec_ms: float, tokens_per_round: float, plain_ms: float,
         explored: bool = True) -> None:
    """Both modes measured in `rows`' bucket; explored: as after its first exploration (which comes early)."""
    for _ in range(WARM):
        spec_launch(gate, rows, ms_per_round=spec_ms, tokens_per_round=tokens_per_round)
        plain_launch(gate, rows, ms_per_step=plain_ms)
    gate.buckets[bucket_of(rows)].explored_once = explored


def test_the_first_exploration_comes_early_then_as_the_loss_says():
    """The first choice rests on a fresh server's first launches: the other mode is measured again after
    EXPLORE_EVERY launches, and only then as rarely as its loss allows."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=1.0, plain_ms=3.0, explored=False)     # plain loses 2/3
    assert gate.speculate(1) and gate.buckets[0].explore_after() == EXPLORE_EVERY
    assert feed(gate, 1, EXPLORE_EVERY + EXPLORE_RUN) == [True] * EXPLORE_EVERY + [False] * EXPLORE_RUN
    assert gate.buckets[0].explored_once and gate.buckets[0].explore_after() == EXPLORE_MAX


def test_speculation_stays_where_it_pays():
    gate = SpecGate()
    warm(gate, 16, spec_ms=2.0, tokens_per_round=3.0, plain_ms=1.0)     # plain loses a third
    every = gate.buckets[bucket_of(16)].explore_after()
    assert every == round(EXPLORE_RUN * (1 / 3) / EXPLORE_COST)
    assert feed(gate, 16, every) == [True] * every
    assert feed(gate, 16, EXPLORE_RUN + 1) == [False] * EXPLORE_RUN + [True]    # then a plain run, to keep measuring


@pytest.mark.parametrize("plain_ms,every", [(1.0, 16), (1.04, 16), (1.1, 36), (1.5, 133), (3.0, 256)])
def test_a_mode_that_loses_by_more_is_explored_less_often(plain_ms, every):
    """Exploring costs about EXPLORE_COST of the time: runs of EXPLORE_RUN launches, further apart the more
    the other mode loses (between EXPLORE_EVERY and EXPLORE_MAX launches)."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=1.0, plain_ms=plain_ms)
    assert gate.speculate(1) and gate.buckets[0].explore_after() == every
    assert EXPLORE_EVERY <= every <= EXPLORE_MAX


def test_the_prefill_launches_speculative_decodes_wait_for_count_against_speculation():
    """Speculative decodes cannot share a launch with prompt chunks: under a stream of arrivals each
    arrival costs them a launch in which they emit nothing (plain decodes fold it into a step)."""
    gate = SpecGate()
    warm(gate, 16, spec_ms=2.0, tokens_per_round=3.0, plain_ms=1.0)     # decode launches alone: speculation wins
    bucket = gate.buckets[bucket_of(16)]
    assert gate.speculate(16) and bucket.spec_rate() == pytest.approx(1.5 * bucket.plain_rate())
    for _ in range(WINDOW // 2):                     # a prefill launch as long as a decode launch before each
        gate.waited(16, 8e-3)
        spec_launch(gate, 16, ms_per_round=2.0, tokens_per_round=3.0)
    assert bucket.spec_rate() == pytest.approx(0.75 * bucket.plain_rate())
    assert not gate.speculate(16)
    gate.waited(0, 1.0)                              # nobody waited: nothing charged
    assert gate.buckets[0].spec_rate() is None and not gate.buckets[0].spec


def test_speculation_that_only_waited_for_a_whole_window_emitted_nothing():
    """Arrival after arrival, a plain bucket's speculative exploration waits for prefill launches and never
    decodes: its window holds waits alone. Its rate is then 0 (it emitted nothing), not unknown: the gate
    keeps deciding (comparing an unknown rate took the rank down) and explores again soon."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=4.0, tokens_per_round=1.0, plain_ms=1.0)      # plain wins
    bucket = gate.buckets[0]
    assert not gate.speculate(1)
    for _ in range(WINDOW):
        gate.waited(1, 2e-3)
    assert not gate.speculate(1)
    assert bucket.spec_rate() == 0.0 and bucket.explore_after() == EXPLORE_EVERY
    assert [e.spec_tokens_per_s for e in gate.estimates()] == [0.0]
    spec_launch(gate, 1, ms_per_round=1.0, tokens_per_round=3.0)        # an exploration that decoded
    assert bucket.spec_rate() > 0


def test_a_burst_of_prompts_costs_each_mode_one_launch_not_the_prompts_time():
    """A lone decoding request while fifteen prompts are read: speculating, it waits for their 60 ms
    prefill; plain, its step is folded into it. The prompts' time is paid either way: each mode is
    charged one launch of its own there (its window's lower median), so a burst does not move a bucket
    that serves one request at a time."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=2.0, plain_ms=1.0)
    bucket = gate.buckets[0]
    spec, plain = bucket.spec_rate(), bucket.plain_rate()
    gate.waited(1, 0.060)
    gate.observe(1, False, 0.060, 1, beside_prompts=True)
    assert bucket.spec[-1] == (0.004, 0.0) and bucket.plain[-1] == (0.004, 1.0)     # 4-round / 4-step launches
    assert bucket.spec_rate() == pytest.approx(spec * 4 / 5) and bucket.plain_rate() == pytest.approx(plain * 17 / 20)
    gate.observe(1, False, 0.060, 1)                 # a plain launch of decodes alone keeps its length (clipped at 4x)
    assert bucket.plain[-1] == (0.060, 1.0)


def test_exploring_speculation_in_a_batch_waits_for_requests_to_take_finished_rows_places():
    """Rows that speculate finish unevenly: with nobody queued, a batch's last rows would run on alone.
    A plain bucket of several rows explores speculation only while requests wait; one row at once."""
    gate = SpecGate()
    for rows in (1, 16):
        warm(gate, rows, spec_ms=3.0, tokens_per_round=1.2, plain_ms=1.0)
        assert not gate.speculate(rows)
        feed(gate, rows, gate.buckets[bucket_of(rows)].explore_after())
    assert gate.buckets[bucket_of(16)].exploring() and not gate.speculate(16, queued=False)
    gate.fed(16, False)
    assert gate.buckets[bucket_of(16)].exploring()                 # still due
    assert gate.speculate(16, queued=True) and gate.speculate(1, queued=False)


def test_hysteresis_keeps_the_mode_between_the_two_thresholds():
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=1.0, plain_ms=LEAVE + 0.01)    # speculation just above LEAVE
    assert gate.speculate(1)
    for _ in range(WINDOW):                          # the window moves: now below LEAVE
        plain_launch(gate, 1, ms_per_step=LEAVE - 0.01)
    assert not gate.speculate(1)
    for _ in range(WINDOW):                          # back to even: plain stays
        plain_launch(gate, 1, ms_per_step=1.0)
    assert not gate.speculate(1)
    for _ in range(WINDOW):                          # above RETURN: speculation again
        plain_launch(gate, 1, ms_per_step=RETURN + 0.01)
    assert gate.speculate(1)


@pytest.mark.parametrize("plain_now_ms,keeps_speculating", [(3.0, True), (1.0, False)])
def test_a_stale_other_mode_is_measured_again_before_a_switch(plain_now_ms, keeps_speculating):
    """Speculation slows 3x after plain was last measured (a whole window ago): the gate does not switch
    on the stale plain rate, it explores plain at once. If plain slowed too (the machine did), speculation
    stays; if plain is as fast as before (speculation itself got worse), the bucket turns plain."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=2.0, plain_ms=1.0)
    bucket = gate.buckets[0]
    assert gate.speculate(1)
    for _ in range(WINDOW):
        spec_launch(gate, 1, ms_per_round=3.0, tokens_per_round=2.0)
    assert bucket.spec_rate() < LEAVE * bucket.plain_rate() and bucket.other_is_stale()
    assert feed(gate, 1, EXPLORE_RUN) == [False] * EXPLORE_RUN and bucket.speculating    # measuring plain again
    for _ in range(EXPLORE_RUN):
        plain_launch(gate, 1, ms_per_step=plain_now_ms)
    assert not bucket.other_is_stale()
    assert gate.speculate(1) == keeps_speculating and bucket.speculating == keeps_speculating


def test_one_slow_launch_does_not_flip_a_bucket():
    gate = SpecGate()
    warm(gate, 2, spec_ms=2.0, tokens_per_round=3.0, plain_ms=1.0)
    for _ in range(4):
        spec_launch(gate, 2, ms_per_round=2.0, tokens_per_round=3.0)
    assert gate.speculate(2)
    spec_launch(gate, 2, ms_per_round=200.0, tokens_per_round=3.0)      # a pause on a busy machine
    assert gate.speculate(2)
    assert gate.buckets[bucket_of(2)].spec_rate() > 1000 * RETURN


def test_plain_explores_speculation_in_runs_and_a_rise_in_acceptance_turns_it_back_on():
    gate = SpecGate()
    warm(gate, 1, spec_ms=3.0, tokens_per_round=1.5, plain_ms=1.0)      # 500 against 1000 tok/s
    assert not gate.speculate(1)
    every = gate.buckets[0].explore_after()
    assert every == round(EXPLORE_RUN * 0.5 / EXPLORE_COST)
    assert feed(gate, 1, every) == [False] * every
    assert gate.speculate(1) and gate.speculate(1)   # exploring: until a speculative launch is fed
    assert feed(gate, 1, EXPLORE_RUN) == [True] * EXPLORE_RUN
    assert gate.explorations == EXPLORE_RUN and feed(gate, 1, every) == [False] * every
    gate.fed(1, True)                                # a run cut short by a launch that could not explore
    gate.fed(1, False)
    assert feed(gate, 1, every) == [False] * (every - 1) + [True]
    launches = 0                                     # the text drafts well now: 5 tokens a round
    while not gate.buckets[0].speculating and launches < EXPLORE_RUN:
        gate.fed(1, True)
        spec_launch(gate, 1, ms_per_round=3.0, tokens_per_round=5.0)
        launches += 1
        gate.speculate(1)
    assert gate.buckets[0].speculating and 1 < launches <= EXPLORE_RUN   # over a window, within a run
    assert feed(gate, 1, EXPLORE_EVERY) == [True] * EXPLORE_EVERY
    assert not gate.buckets[0].exploring()


# ---- the policy on plain data ---------------------------------------------------------------

class Scripted(SpecGate):
    """A gate that answers `modes` in turn, one per launch fed (a plain launch it wanted but could
    not have yet, behind a drafting step, it keeps asking for)."""

    def __init__(self, modes: list[bool], settle_after: int | None = None):
        super().__init__()
        self.modes, self.launches, self.settle_after = modes, 0, settle_after

    def speculate(self, rows: int, queued: bool = True) -> bool:
        return self.modes[self.launches % len(self.modes)]

    def settled_plain(self, rows: int) -> bool:
        """From launch `settle_after` on, a plain launch is the bucket's settled choice."""
        return self.settle_after is not None and self.launches >= self.settle_after and not self.speculate(rows)

    def fed(self, rows: int, speculative: bool) -> None:
        self.launches += 1


def make(policy: SpeculativeDecoding, rows: int = 8, context: int = 4096, num_slots: int = 4096) -> Scheduler:
    config = SchedulerConfig(max_running_requests=rows, max_queued_requests=100, max_prefill_tokens=128,
                             chunked_prefill_size=64, context_length=context, future_slots=2 * rows + 2)
    return Scheduler(config, KVPool(num_slots, 1, rows), eos_ids=frozenset({49}), policy=policy)


def prefilled(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    sched.add(rid, prompt, params)
    batch = sched.schedule()
    sched.process(batch, StepOutput(tokens=[[prompt[-1] + 1]]))
    return sched.requests[rid]


def test_the_gate_sends_greedy_decodes_plain_in_runs_through_a_chain0_step():
    gate = Scripted([True, False, False])
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=gate)
    sched = make(spec)
    req = prefilled(sched, "g", [1, 2, 3])
    drafting = sched.schedule()
    assert drafting.is_spec_decode and drafting.chain == 3 and gate.launches == 1
    chain0 = sched.schedule()                    # the gate wants plain; the drafting step is in flight
    assert chain0.is_spec_decode and chain0.chain == 0 and chain0.steps == 1 and gate.launches == 1
    sched.process(drafting, StepOutput(tokens=[[5, 6, 7, 8] * 4], rounds=[[4] * 4]))
    run = sched.schedule()                       # no drafting step in flight: a plain run
    assert not run.is_spec_decode and run.steps == 4 and [(s.q_len, s.decode) for s in run.seqs] == [(1, True)]
    assert run.input_ids == [-chain0.seqs[0].future_id] and run.seqs[0].start == req.kv_len - 4
    assert (spec.gate_steps, spec.off_steps, gate.launches) == (5, 0, 2)
    sched.process(chain0, StepOutput(tokens=[[21]]))
    sched.process(run, StepOutput(tokens=[[22, 23, 24, 25]]))
    assert req.kv_len == len(req.all_ids) - 1 and req.decode.extra_rounds == 0
    assert req.decode.verify_steps == 4 + 1 + 4              # rounds, a chain-0 step, a run's steps


def test_plain_decodes_join_a_waiting_prompt_and_sampling_batches_keep_speculating():
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=Scripted([False]))
    sched = make(spec)
    prefilled(sched, "g", [1, 2, 3])
    sched.add("p", [7, 8, 9, 10], GREEDY)
    mixed = sched.schedule()                     # plain: one token, beside the prompt
    assert not mixed.is_spec_decode and mixed.steps == 1
    assert [(s.req.rid, s.q_len) for s in mixed.seqs] == [("g", 1), ("p", 4)]
    sched.process(mixed, StepOutput(tokens=[[5], [11]]))
    sched.add("s", [4, 5], SamplingParams(max_new_tokens=40, temperature=0.8))
    prefill = sched.schedule()
    assert [(s.req.rid, s.q_len) for s in prefill.seqs] == [("g", 1), ("p", 1), ("s", 2)]
    sched.process(prefill, StepOutput(tokens=[[6], [12], [6]]))
    with_sampling = sched.schedule()             # its samples would depend on which steps speculate
    assert with_sampling.is_spec_decode and with_sampling.chain == 3 and spec.gate_steps == 2


class Charged(Scripted):
    """A scripted gate that records what it is charged."""

    def __init__(self, modes: list[bool]):
        super().__init__(modes)
        self.charges: list[tuple] = []

    def observe(self, rows, speculative, seconds, steps, tokens=0, beside_prompts=False):
        self.charges.append(("spec" if speculative else "plain", rows, seconds, steps, tokens, beside_prompts))

    def waited(self, rows, seconds):
        self.charges.append(("waited", rows, seconds))


def test_the_gate_is_charged_each_launch_of_its_mode_prompts_included():
    """Speculative decodes charged the prefill launches they wait for; plain decodes their launch with
    prompt chunks beside them; a sampling batch, a prefill with nobody waiting, a chain-0 step: nothing."""
    gate = Charged([True])
    spec = SpeculativeDecoding(spec_tokens=4, rounds=1, gate=gate)
    sched = make(spec)
    prefilled(sched, "a", [1, 2, 3])
    prefilled(sched, "b", [4, 5, 6])                 # "a" waited for it (the gate's first launch not fed yet)
    drafting = sched.schedule()
    assert drafting.is_spec_decode and drafting.spec.gate_rows == 2
    spec.observe_launch(drafting, 0.01, 1, StepOutput(tokens=[[7, 8], [9]]), cycle=0.02)
    sched.process(drafting, StepOutput(tokens=[[7, 8], [9]]))
    sched.add("c", [1, 2], GREEDY)
    waiting = sched.schedule()                       # speculative decodes cannot join a prompt: they wait
    assert [s.req.rid for s in waiting.seqs] == ["c"] and waiting.spec.gate_rows == 2
    spec.observe_launch(waiting, 0.004, 1, StepOutput(tokens=[[3]]), cycle=0.005)
    sched.process(waiting, StepOutput(tokens=[[3]]))
    gate.modes = [False]
    sched.add("d", [1, 2, 3, 4], GREEDY)
    mixed = sched.schedule()                         # plain decodes fold the prompt into their step
    assert [s.req.rid for s in mixed.seqs] == ["a", "b", "c", "d"] and mixed.spec.gate_rows == 3
    spec.observe_launch(mixed, 0.006, 1, StepOutput(tokens=[[1], [1], [1], [1]]), cycle=0.007)
    assert gate.charges == [("spec", 2, 0.02, 1, 3, False), ("waited", 2, 0.005), ("plain", 3, 0.007, 1, 0, True)]
    sched.process(mixed, StepOutput(tokens=[[1], [1], [1], [1]]))
    sched.add("s", [1, 2], SamplingParams(max_new_tokens=40, temperature=0.8))
    gate.modes = [True]
    sampling_prompt = sched.schedule()               # four greedy decodes wait for it
    assert sampling_prompt.spec.gate_rows == 4
    sched.process(sampling_prompt, StepOutput(tokens=[[3]]))
    sched.add("e", [1, 2], GREEDY)
    with_sampling = sched.schedule()                 # a sampling decode among those waiting: not gated
    assert [s.req.rid for s in with_sampling.seqs] == ["e"] and with_sampling.spec.gate_rows == 0


def test_a_launch_that_yielded_to_an_arrival_is_not_charged():
    """A greedy launch of rounds records the arrivals it was planned with; one that ran fewer rounds
    because a prompt came since (spec/arrivals.py) is not charged to speculation (a plain run would have
    run whole while the prompt waited). One whose rounds all ran, or that ended with nobody arriving
    (its rows ended), is charged."""
    gate = Charged([True])
    spec = SpeculativeDecoding(spec_tokens=4, rounds=8, gate=gate)
    sched = make(spec)
    prefilled(sched, "a", [1, 2, 3])
    launch = sched.schedule()
    assert launch.is_spec_decode and launch.steps > 1 and launch.spec.yield_at == spec.arrivals.count
    spec.observe_launch(launch, 0.01, launch.steps - 1, StepOutput(tokens=[[7, 8]]), cycle=0.01)   # rows ended
    assert len(gate.charges) == 1
    sched.add("b", [4, 5], GREEDY)                   # a prompt arrives while the launch runs: it yields
    assert spec.arrivals.since(launch.spec.yield_at)
    spec.observe_launch(launch, 0.002, 1, StepOutput(tokens=[[7, 8]]), cycle=0.002)
    assert len(gate.charges) == 1
    spec.observe_launch(launch, 0.01, launch.steps, StepOutput(tokens=[[7, 8]]), cycle=0.01)     # ran whole
    assert len(gate.charges) == 2


@pytest.mark.parametrize("falls_behind", [False, True], ids=["catches-up", "eagle"])
def test_a_dip_below_the_load_decodes_as_the_loads_batch_size_chose(falls_behind):
    """Four requests decode plainly (their bucket is settled on plain); three end and one runs alone while
    their successors arrive. Speculating alone it would run ahead of them: it decodes as the load's batch
    size chose and charges no bucket, and so does a request that arrives then (an EAGLE head does not read
    its prompt). Once two prompts in a row found the server idle, a lone request speculates again (one
    request at a time, speculation wins here)."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=1.0, tokens_per_round=3.0, plain_ms=1.0)       # one request: speculation wins
    warm(gate, 4, spec_ms=4.0, tokens_per_round=1.5, plain_ms=1.0)       # four: plain wins
    assert gate.speculate(1) and not gate.speculate(4) and gate.settled_plain(4)
    spec = SpeculativeDecoding(spec_tokens=4, rounds=1, gate=gate, draft_falls_behind=falls_behind)
    sched = make(spec)
    short = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    prefilled(sched, "a", [1, 2, 3])
    for rid in "bcd":
        prefilled(sched, rid, [4, 5], short)
    for _ in range(2):                               # b, c and d emit their last two tokens
        step = sched.schedule()
        assert not step.is_spec_decode and len(step.seqs) == 4 and step.spec.gate_rows == 4
        sched.process(step, StepOutput(tokens=[[7]] * 4))
    assert [r.rid for r in sched.running] == ["a"]
    dip = sched.schedule()
    assert not dip.is_spec_decode and dip.spec.gate_rows == 0
    assert spec.plain_now == ("behind" if falls_behind else "lull")    # a row the head skipped is behind already
    sched.process(dip, StepOutput(tokens=[[7]]))
    sched.add("e", [1, 2, 3], GREEDY)
    joined = sched.schedule()                        # a's plain decode and e's prompt
    sched.process(joined, StepOutput(tokens=[[7]] * len(joined.sampling)))
    arrival = sched.requests["e"]
    assert arrival.decode.behind == falls_behind     # its prompt unread where the load's size is settled plain
    sched.abort("a", "abort")
    dip = sched.schedule()
    assert not dip.is_spec_decode and dip.spec.gate_rows == 0
    sched.process(dip, StepOutput(tokens=[[7]]))
    sched.abort("e", "abort")
    wave = prefilled(sched, "f", [1, 2, 3])          # found the server idle: once is how a wave starts
    assert wave.decode.behind == falls_behind        # the head did not read its prompt either
    assert not sched.schedule().is_spec_decode
    sched.abort("f", "abort")
    prefilled(sched, "g", [1, 2, 3])                 # twice in a row: one request at a time
    assert sched.schedule().is_spec_decode


def test_a_head_that_cannot_catch_up_steps_aside_once_the_gate_settles_on_plain():
    """An EAGLE head reads the target's features of a step or never: once the gate has settled on plain
    decoding, the head skips the plain runs (and the prompts that join them), and their requests decode
    plainly to their end whatever the gate says later; a retracted request is read again."""
    gate = Scripted([False], settle_after=1)
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=gate, draft_falls_behind=True)
    sched = make(spec)
    req = prefilled(sched, "g", [1, 2, 3])
    assert not req.decode.behind                      # not settled yet: the head read the prompt
    read = sched.schedule()
    assert not read.is_spec_decode and not read.spec.draft_skip and not req.decode.behind
    sched.process(read, StepOutput(tokens=[[4, 5, 6, 7]]))
    run = sched.schedule()                            # settled: the head skips the run
    assert not run.is_spec_decode and run.steps == 4 and run.spec.draft_skip and req.decode.behind
    sched.process(run, StepOutput(tokens=[[8, 9, 10, 11]]))
    gate.modes = [True]                               # the gate would speculate now
    sched.add("p", [7, 8, 9], GREEDY)
    mixed = sched.schedule()                          # the behind request stays plain; the prompt joins
    assert not mixed.is_spec_decode and mixed.spec.draft_skip
    assert [(s.req.rid, s.q_len) for s in mixed.seqs] == [("g", 1), ("p", 3)]
    assert sched.requests["p"].decode.behind and spec.gate_steps == 9
    spec.on_retract(req)
    assert not req.decode.behind

    gate = Scripted([False], settle_after=0)          # settled before a greedy prompt arrives: not read
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=gate, draft_falls_behind=True)
    sched = make(spec)
    req = prefilled(sched, "g", [1, 2, 3])
    assert req.decode.behind
    sched.add("s", [4, 5], SamplingParams(max_new_tokens=40, temperature=0.8))
    with_sampling = sched.schedule()                  # a sampling prompt: the batch is read
    assert not with_sampling.spec.draft_skip and not sched.requests["s"].decode.behind
    sched.process(with_sampling, StepOutput(tokens=[[4], [6]]))
    drafting = sched.schedule()                       # and a batch with a sampling request speculates
    assert drafting.is_spec_decode and drafting.chain == 3

    exploring = Scripted([False])                     # plain, but not settled (exploring, or not measured)
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=exploring, draft_falls_behind=True)
    sched = make(spec)
    req = prefilled(sched, "g", [1, 2, 3])
    run = sched.schedule()
    assert not run.is_spec_decode and not run.spec.draft_skip and not req.decode.behind

    settled = Scripted([False], settle_after=0)       # a draft that reads everything or catches up
    for catches_up in (False, True):
        spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=settled, draft_catches_up=catches_up)
        sched = make(spec)
        req = prefilled(sched, "g", [1, 2, 3])
        run = sched.schedule()
        assert run.spec.draft_skip == catches_up and not req.decode.behind


def test_prompts_go_unread_where_plain_is_settled_but_one_batch_in_explore_every():
    gate = SpecGate()
    warm(gate, 4, spec_ms=10, tokens_per_round=1.2, plain_ms=4)
    assert not gate.speculate(4) and gate.settled_plain(4) and not gate.settled_plain(1)
    assert not gate.skip_prompts(1) and not gate.skip_prompts(0)       # bucket 1 measured nothing
    every = gate.buckets[bucket_of(4)].explore_after()
    skipped = [gate.skip_prompts(5) for _ in range(every + 1)]
    assert skipped == [True] * every + [False]
    assert gate.speculate(4)                          # the prompts read explore speculation


def test_runs_of_requests_behind_count_towards_the_next_exploration_and_are_charged_to_plain():
    """Where a bucket has settled on plain, its requests are behind and decode plainly whatever the gate
    says: each such run is still the bucket's plain launch, so it brings the next exploration nearer (one
    request after another at concurrency 1 would otherwise explore only once per `every` prompts) and is
    charged to plain as it ran, the head skipping it: what speculation must beat to come back."""
    gate = SpecGate()
    warm(gate, 1, spec_ms=3.0, tokens_per_round=1.2, plain_ms=1.0)
    assert not gate.speculate(1) and gate.settled_plain(1)
    spec = SpeculativeDecoding(spec_tokens=4, rounds=4, gate=gate, draft_falls_behind=True)
    sched = make(spec)
    bucket = gate.buckets[0]
    every = bucket.explore_after()
    req = prefilled(sched, "g", [1, 2, 3], SamplingParams(max_new_tokens=4 * every, temperature=0, ignore_eos=True))
    assert req.decode.behind and bucket.since_other == 1                     # its prompt went unread
    for launch in range(2, every):
        run = sched.schedule()
        assert not run.is_spec_decode and run.spec.draft_skip and run.spec.gate_rows == 1
        spec.observe_launch(run, 0.004, run.steps, StepOutput(tokens=[[5] * run.steps]), cycle=0.004)
        sched.process(run, StepOutput(tokens=[[5] * run.steps]))
        assert bucket.since_other == launch
    assert bucket.plain[-1] == (0.004, 4.0) and bucket.explore_after() == every    # charged: 4 steps in 4 ms
    assert not bucket.exploring()
    sched.schedule()
    assert bucket.exploring()                                   # due: the next prompt is read and explores
    assert not gate.skip_prompts(1)
    run = sched.schedule()                                      # a run of decodes alone keeps its whole cycle
    spec.observe_launch(run, 0.006, run.steps, StepOutput(tokens=[[5] * run.steps]), cycle=0.006)
    assert bucket.plain[-1] == (0.006, float(run.steps))


def test_the_fixed_rule_comes_first_and_counts_apart():
    spec = SpeculativeDecoding(spec_tokens=4, off_batch_size=2, rounds=4, gate=Scripted([False]))
    sched = make(spec)
    prefilled(sched, "a", [1, 2])
    sched.add("b", [3, 4], GREEDY)
    sched.process(prefill := sched.schedule(), StepOutput(tokens=[[5]] * len(prefill.sampling)))
    run = sched.schedule()
    assert not run.is_spec_decode and run.steps == 4 and (spec.off_steps, spec.gate_steps) == (4, 1)


class GateDevice:
    """Runs prefill batches, plain decodes (one step or a run) and speculative steps the way a
    worker does, row by row, on plain data: token = next_token(last), a speculative round accepts
    a random number of its drafts. It keeps what the worker keeps (each row's length, its bonus
    token, how far its draft has read) and checks what the scheduler planned against it."""

    def __init__(self, catches_up: bool, seed: int = 0):
        self.catches_up, self.rng = catches_up, random.Random(seed)
        self.behind: set[int] = set()           # rows whose draft skipped what it cannot catch up on
        self.futures, self.table = {}, set()
        self.kv, self.bonus, self.draft = {}, {}, {}
        self.kinds: list[str] = []

    def run(self, batch) -> StepOutput:
        self.table.update(zip(batch.table_rows, batch.table_pos))
        if batch.is_spec_decode:
            self.kinds.append("draft" if batch.chain else "chain0")
            return StepOutput.joined([self.spec_round(batch, i) for i in range(batch.steps)])
        if any(seq.decode for seq in batch.seqs):
            self.kinds.append("plain run" if batch.steps > 1 else "plain")
        return self.plain(batch)

    def plain(self, batch) -> StepOutput:
        runs, offset = [], 0
        for seq in batch.seqs:
            fed = [self.futures[-t] if t < 0 else t for t in batch.input_ids[offset:offset + seq.q_len]]
            offset += seq.q_len
            end = seq.start + (batch.steps if seq.decode else seq.q_len)
            assert all((seq.row, pos) in self.table for pos in range(seq.start, end)), "a position without a slot"
            if seq.decode:
                assert seq.start == self.kv[seq.row], "a plain decode from a length that is only a bound"
                assert fed == [self.bonus[seq.row]], "a plain decode reads another token than the last emitted"
            self.read_draft(seq.row, seq.start, end, batch.spec.draft_skip)
            if seq.samples:
                run = [next_token(fed[-1])]
                while len(run) < batch.steps:
                    run.append(next_token(run[-1]))
                self.kv[seq.row], self.bonus[seq.row] = end, run[-1]
                self.futures[seq.future_id] = run[-1]
                runs.append(run)
        return StepOutput(tokens=runs)

    def read_draft(self, row: int, start: int, end: int, skip: bool) -> None:
        if start == 0:
            self.draft[row] = 0                 # a new request in this row
            self.behind.discard(row)
        if skip and not self.catches_up:
            self.behind.add(row)
        if not skip:
            assert self.draft[row] >= start, "the draft reads past a hole it never caught up on"
            self.draft[row] = end

    def spec_round(self, batch, index: int) -> StepOutput:
        runs = []
        for i, seq in enumerate(batch.seqs):
            row, length = seq.row, self.kv[seq.row]
            lag = batch.spec.draft_lag[i] if index == 0 else 0
            if batch.chain:                     # what the draft reads before drafting
                assert row not in self.behind or not all(p.greedy for p in batch.sample_params), \
                    "a greedy batch drafts after skipping what it cannot catch up on"
                if row not in self.behind:      # (one behind, in a sampling batch, drafts from holes: poorly)
                    assert self.draft[row] >= (length - 1 - lag if self.catches_up else length), "a stale draft"
            assert all((row, pos) in self.table for pos in range(length, length + batch.chain + 1))
            run = [next_token(self.bonus[row])]
            for _ in range(self.rng.randrange(batch.chain + 1)):
                run.append(next_token(run[-1]))
            self.kv[row], self.bonus[row] = length + len(run), run[-1]
            if batch.chain or not self.catches_up:      # an EAGLE head extends even by one token
                self.draft[row] = length + len(run) - (1 if self.catches_up else 0)
            self.futures[seq.future_id] = run[-1]
            runs.append(run)
        return StepOutput(tokens=runs)


def next_token(token: int) -> int:
    return (token + 1) % 50 if token != 48 else 0            # as tests/test_scheduler.py's FakeDevice: never 49


def drive_gated(sched: Scheduler, device: GateDevice, overlap: bool, arrivals: dict[int, list]) -> dict:
    """Drive the scheduler through the engine core over `device`; requests arrive at the steps
    `arrivals` names. Returns every request by id."""
    import tests.test_scheduler as plain
    requests = {}

    def arrive(step: int) -> None:
        for rid, prompt, params in arrivals.pop(step, []):
            assert sched.add(rid, prompt, params) is None
            requests[rid] = sched.requests[rid]
    original, plain.FakeDevice = plain.FakeDevice, lambda: device
    try:
        while arrivals:                        # (an engine that ran dry gets the next arrivals at once)
            arrive(min(arrivals))
            drive(sched, overlap, max_steps=5000, on_step=lambda s: arrive(s.step))
    finally:
        plain.FakeDevice = original
    return requests


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("catches_up,falls_behind", [(False, False), (True, False), (False, True)],
                         ids=["eagle-like", "standalone-like", "eagle-stepping-aside"])
def test_outputs_are_exact_with_the_gate_switching(overlap, rounds, catches_up, falls_behind):
    """Requests arrive over time, some of them sampling, one running into the context; a gate
    that switches every launch or two (and, stepping aside, settles on plain from launch 6)."""
    spec = SpeculativeDecoding(spec_tokens=4, draft_catches_up=catches_up, rounds=rounds,
                               draft_falls_behind=falls_behind,
                               gate=Scripted([True, False, False, True, True, False], 6 if falls_behind else None))
    sched = make(spec, rows=6, context=300)
    rng = random.Random(rounds)
    arrivals: dict[int, list] = {}
    for i in range(10):
        prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(3, 90))]
        params = SamplingParams(max_new_tokens=rng.randrange(2, 60), ignore_eos=True,
                                temperature=0.8 if i % 4 == 3 else 0)
        arrivals.setdefault(0 if i < 2 else rng.randrange(1, 30), []).append((f"r{i}", prompt, params))
    long_prompt = [1 + i % 40 for i in range(281)]                # ends at the context, 19 tokens in
    arrivals.setdefault(5, []).append(("long", long_prompt, SamplingParams(max_new_tokens=100, temperature=0,
                                                                           ignore_eos=True)))
    wanted = {rid: (prompt, params) for step in arrivals.values() for rid, prompt, params in step}
    device = GateDevice(catches_up)
    requests = drive_gated(sched, device, overlap, arrivals)
    for rid, (prompt, params) in wanted.items():
        want = expected(prompt, params.max_new_tokens)[:300 - len(prompt)]
        assert requests[rid].output_ids == want, rid
        if not overlap:                         # (with overlap a finished request's last launch is never processed)
            assert requests[rid].decode.extra_rounds == 0 and requests[rid].decode.drafting == 0
    assert sched.pool.used_slots == 0 and len(sched.pool.free_rows) == 6
    kinds = set(device.kinds)
    assert {"draft", "plain"} <= kinds and ("plain run" in kinds) == (rounds > 1)
    assert "chain0" in kinds or not overlap          # plain right behind a drafting step in flight
    assert spec.gate_steps > 0 and spec.off_steps == 0
    assert any(r.decode.behind for r in requests.values()) == falls_behind


# ---- the embedded model, in-process ---------------------------------------------------------

BASE = ["--max-total-tokens", "4096", "--max-running-requests", "4", "--max-launch-ms", "0"]
ONE_STEP, FOUR_STEPS = ["--num-scheduler-steps", "1"], ["--num-scheduler-steps", "4"]
LIMITS = (40, 33, 25, 37)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    from tests.e2e_prompts import CODE_PROMPTS
    from tests.server_harness import DENSE
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(CODE_PROMPTS[i]) for i in range(len(LIMITS))]


class Served:
    """What an in-process engine emitted, and the kinds of decode launches it ran."""

    def __init__(self):
        self.outputs: list[list[int]] = []
        self.kinds: list[str] = []
        self.drafted_tokens = self.drafted_rounds = 0     # emitted by rounds that drafted, and their row-rounds
        self.first_tokens = self.first_rows = 0           # the same of the first round of each launch
        self.unread = 0                                    # launches the draft did not read (stepping aside)

    def observe(self, done) -> None:
        batch = done.batch
        self.unread += bool(batch.spec and batch.spec.draft_skip)
        if batch.is_spec_decode:
            self.kinds.append("draft" if batch.chain else "chain0")
            if batch.chain:
                rounds = len(done.result.rounds) if done.result.rounds is not None else batch.steps
                self.drafted_tokens += sum(len(run) for run in done.output.tokens)
                self.drafted_rounds += rounds * len(batch.seqs)
                firsts = [r[0] for r in done.output.rounds if r] if done.output.rounds else \
                    [len(run) for run in done.output.tokens]
                self.first_tokens += sum(firsts)
                self.first_rows += len(firsts)
        elif any(seq.decode for seq in batch.seqs):
            self.kinds.append("plain run" if batch.steps > 1 else "plain")

    @property
    def tokens_per_round(self) -> float:
        return self.drafted_tokens / self.drafted_rounds

    @property
    def first_round_tokens(self) -> float:
        """Tokens a row's first round of a launch emitted, on average (with the gate switching every
        launch: the round right after a plain run)."""
        return self.first_tokens / self.first_rows


async def serve(flags: list[str], prompts: list[list[int]], gate: SpecGate | None = None,
                limits: tuple[int, ...] = LIMITS) -> Served:
    """Greedy requests, half of them arriving while the first decode; `gate` replaces the policy's."""
    from tests.server_harness import DENSE
    from tests.test_engine_core import Engine
    engine = Engine(["--model-path", str(DENSE), *BASE, *flags])
    served = Served()
    try:
        if gate is not None:
            engine.core.scheduler.policy.gate = gate
        engine.core.observers.append(served.observe)
        params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in limits]
        half = len(prompts) // 2
        reqs = [engine.add(f"r{i}", prompts[i], params[i]) for i in range(half)]
        for _ in range(4):
            await engine.core.step()
        reqs += [engine.add(f"r{i}", prompts[i], params[i]) for i in range(half, len(prompts))]
        await engine.finish()
        assert engine.core.scheduler.pool.used_slots == 0
        served.outputs = [r.output_ids for r in reqs]
        return served
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(prompts):
    import asyncio
    return asyncio.run(serve(["--speculative-algorithm", "none", *ONE_STEP], prompts)).outputs


@pytest.mark.parametrize("steps", [ONE_STEP, FOUR_STEPS], ids=["one-step", "four-steps"])
@pytest.mark.parametrize("overlap", [[], ["--disable-overlap-schedule"]], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "ngram", "standalone"])
async def test_greedy_outputs_stay_plain_decodings_with_the_gate_switching(algorithm, overlap, steps, prompts,
                                                                           reference):
    from tests.engine_harness import ALGORITHMS
    served = await serve([*ALGORITHMS[algorithm], *overlap, *steps], prompts, gate=Scripted([True, False]))
    assert served.outputs == reference
    kinds = set(served.kinds)
    assert "draft" in kinds and ("plain run" if steps == FOUR_STEPS else "plain") in kinds
    assert "chain0" in kinds or overlap


@pytest.mark.parametrize("algorithm,flags", [("eagle", FOUR_STEPS),
                                             ("eagle3", ["--disable-overlap-schedule", *ONE_STEP])])
async def test_greedy_outputs_stay_plain_decodings_when_the_head_steps_aside(algorithm, flags, prompts, reference):
    """The gate settles on plain from its third launch: the head stops reading, its requests decode
    plainly to their end, and the outputs are plain greedy decoding's."""
    from tests.engine_harness import ALGORITHMS
    served = await serve([*ALGORITHMS[algorithm], *flags], prompts, gate=Scripted([True, False], settle_after=3))
    assert served.outputs == reference
    assert "draft" in served.kinds and served.unread > 0
    assert "draft" not in served.kinds[served.kinds.index("draft") + 4:]   # none after the head stepped aside


@pytest.mark.parametrize("algorithm", ["eagle", "ngram", "standalone"])
async def test_drafts_after_plain_runs_are_as_good_as_without_them(algorithm, prompts):
    """Drafts only change speed, so a draft that missed what plain runs emitted would still give the
    right tokens: compare what the first round of a launch accepts when every launch follows a plain
    run (the EAGLE head read the run, the token history got it, a standalone draft caught up) with
    what rounds accept under speculation alone."""
    from tests.engine_harness import ALGORITHMS
    flags, limits = [*ALGORITHMS[algorithm], *FOUR_STEPS], (120,) * len(LIMITS)
    alone = await serve(flags, prompts, limits=limits)
    switching = await serve(flags, prompts, gate=Scripted([True, False]), limits=limits)
    assert switching.outputs == alone.outputs and switching.kinds.count("plain run") >= 4
    assert switching.first_round_tokens > 0.9 * alone.tokens_per_round


async def test_the_gate_measures_both_modes_as_it_serves(prompts, reference, caplog):
    """The real gate, timing real steps: greedy outputs stay plain decoding's whatever it picks, it
    tried both modes (speculation first, then plain to measure it) and the start-up log says so."""
    import logging
    caplog.set_level(logging.INFO, logger="engine.rank")
    gates = []

    class Kept(SpecGate):                         # the policy's own gate, kept to look at afterwards
        def __init__(self):
            super().__init__()
            gates.append(self)
    served = await serve(["--speculative-algorithm", "eagle", "--speculative-adaptive", "on", *ONE_STEP], prompts,
                         gate=Kept())
    assert served.outputs == reference
    assert "draft" in served.kinds and "plain" in served.kinds
    measured = [e for e in gates[0].estimates() if e.spec_tokens_per_s and e.plain_tokens_per_s]
    assert measured, gates[0].estimates()
    assert any("speculation gate: adaptive" in r.getMessage() for r in caplog.records)


def test_the_flag_turns_the_gate_on_and_off():
    from engine.args import parse_args
    spec = ["--speculative-algorithm", "eagle"]
    assert parse_args(spec + ["--speculative-adaptive", "on"]).adaptive_speculation("cuda")
    assert not parse_args(spec + ["--speculative-adaptive", "off"]).adaptive_speculation("cpu")
    assert not parse_args(["--speculative-algorithm", "none", "--speculative-adaptive", "on"]).adaptive_speculation(
        "cpu")
    import engine.args as args_module             # auto: on on the CPU (the tests' conftest pins it off)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(args_module, "auto_adaptive", lambda device: device == "cpu")
        assert parse_args(spec).adaptive_speculation("cpu") and not parse_args(spec).adaptive_speculation("cuda")


# ---- /metrics ---------------------------------------------------------------------------------

class StatsOnly:
    """The EngineClient surface the metrics read."""

    def __init__(self, stats: list[RankStats]):
        self.stats, self.restarts, self.pd_stats = stats, 0, None

    def rank_stats(self) -> list[RankStats]:
        return self.stats

    def ranks_up(self) -> int:
        return len(self.stats)


def metric_lines(engine) -> dict[str, float]:
    from server.metrics import Metrics
    text = Metrics(engine).render().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tandem_spec_gate")}


class GateSaid:
    """A gate that has explored `explorations` times and estimates `estimates`."""

    def __init__(self, explorations: int, estimates: list[Estimate]):
        self.explorations, self.said = explorations, estimates

    def estimates(self) -> list[Estimate]:
        return self.said


def speculating_rank(rank: int, gate_steps: int, gate) -> RankStats:
    """The speculation table of a rank whose policy ran `gate_steps` plain steps by its gate's choice."""
    policy = SpeculativeDecoding(3, gate=gate)
    policy.gate_steps = gate_steps
    return RankStats(rank, SpecStats(3).stats(policy))


def test_metrics_show_the_gates_counters_and_estimates():
    stats = [speculating_rank(0, 12, GateSaid(1, [Estimate("1", 800.0, 1000.0, False),
                                                   Estimate("2-3", 900.0, 0.0, True)])),
             speculating_rank(1, 30, GateSaid(2, [Estimate("1", 700.0, 1100.0, False)]))]
    m = metric_lines(StatsOnly(stats))
    assert m["tandem_spec_gate_plain_steps_total"] == 42 and m["tandem_spec_gate_explorations_total"] == 3
    assert m['tandem_spec_gate_tokens_per_second{batch_size="1",mode="speculative"}'] == 750
    assert m['tandem_spec_gate_tokens_per_second{batch_size="1",mode="plain"}'] == 1050
    assert m['tandem_spec_gate_tokens_per_second{batch_size="2-3",mode="plain"}'] == 0       # not measured yet
    assert m['tandem_spec_gate_speculating{batch_size="1"}'] == 0
    assert m['tandem_spec_gate_speculating{batch_size="2-3"}'] == 1
    off = metric_lines(StatsOnly([speculating_rank(0, 0, None)]))         # gate off: no estimates
    assert off == {"tandem_spec_gate_plain_steps_total": 0, "tandem_spec_gate_explorations_total": 0}


@pytest.mark.slow
async def test_a_rank_reports_the_gate_on_metrics(prompts):
    """Through a rank process: the gate's counters and estimates reach /metrics."""
    import asyncio
    from tests.engine_harness import engine, run_batch
    from tests.server_harness import DENSE
    flags = ["--model-path", str(DENSE), "--speculative-algorithm", "eagle", "--speculative-adaptive", "on",
             *ONE_STEP]
    def measured(m: dict, mode: str) -> bool:
        return any(key.startswith("tandem_spec_gate_tokens_per_second") and f'mode="{mode}"' in key and value > 0
                   for key, value in m.items())

    async with engine(flags) as client:
        for _ in range(3):           # a bucket measures plain steps after WARM speculative launches: how many
            await run_batch(client, prompts, GREEDY)     # batch sizes a run passes through depends on timing
            for _ in range(25):
                m = metric_lines(client)
                if measured(m, "plain") and measured(m, "speculative"):
                    break
                await asyncio.sleep(0.2)
            if measured(m, "plain") and measured(m, "speculative"):
                break
    assert "tandem_spec_gate_plain_steps_total" in m and "tandem_spec_gate_explorations_total" in m
    rates = {key: value for key, value in m.items() if key.startswith("tandem_spec_gate_tokens_per_second")}
    assert any('mode="plain"' in key and value > 0 for key, value in rates.items()), m
    assert any('mode="speculative"' in key and value > 0 for key, value in rates.items()), m
