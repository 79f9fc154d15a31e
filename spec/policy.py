"""Speculative decoding, CPU side: how the scheduler feeds decoding requests when a draft
proposes tokens (pure Python: no tensors, tested on plain data). The device side is a
speculative worker (spec/base.py).

A speculative decode step feeds each request k+1 positions whose start and accepted length live
on the device. `kv_len` is then an upper bound: each launched step adds k+1, each processed step
gives back what it did not accept, and the pages past the bound are returned. Prefill and
speculative decode go in separate batches (plain decodes join prefill batches).

An all-greedy step drafts no more tokens than its requests can still emit (max_new_tokens, the
context), and a request that must finish with the steps in flight is not fed again.

Under load (at least `off_batch_size` decoding requests) speculation is off: the decodes are
scheduled as without speculation, one token each, in the same batch as prompt chunks
(`feed_plain`). Below that, an adaptive gate (spec/gate.py, --speculative-adaptive) may send an
all-greedy batch's decodes the same way, where speculation is expected to lose at its size. To
the worker such a decode is a one-token last chunk: its prefill hook seeds kv_len and bonus from
it. Its input is the request's future, which every step stores (a speculative step: its last
emitted token). Only a request with no drafting step in flight (`drafting == 0`) can be fed so,
since only then is its kv_len exact; were one in flight, the decodes go as a speculative step that
drafts nothing (chain 0), which also emits exactly one token. With overlap that is the gate's way
from speculation to plain steps (the launch in flight drafts); load grows only through a prefill
batch, and the step before it is processed before the next is scheduled.

With --num-scheduler-steps N (`rounds`), a speculative batch whose requests have no prompt
waiting runs up to N speculative steps back to back in one launch (each round drafts, verifies and
accepts from the state the round before left on the device): it feeds each request N * (k+1)
positions and gives back what the rounds did not accept. Round i samples with the noise key of
the i-th step of the launch, so the outputs are those of N launches of one step each. Plain
decodes with no prompt waiting run up to N steps too (`feed_plain_run`, as engine/multi_step.py
feeds them; kv_len stays exact), and the worker reads the run as a last chunk of N tokens per
request (spec/decoder.py: SpecDecoder.read_run).

A draft model that skipped plain steps catches up in the next drafting step; `draft_lag` (tokens
its draft has not read) is exact on the CPU because each of those steps emitted exactly one
token. Such a draft (`catches_up`) also skips prefill batches under load and those with plain
decodes in them (`draft_skip`): a request whose prompt the draft did not read starts decoding with
draft_lag = P - 1 - draft_end (P prompt tokens, the draft read the first draft_end), and once
one of its chunks was skipped the later ones are too, so what the draft lacks is always the tail
its catch-up reads. A plain decode is such a skipped last chunk, so the same rule counts its lag.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.batch import ScheduledBatch, SeqWork, StepOutput
from engine.launch_budget import LaunchBudget
from engine.policy import DecodePolicy
from engine.request import Request, Status
from spec.arrivals import Arrivals
from spec.gate import SpecGate, bucket_of
from spec.plan import SpecPlan

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

SPEC_NOISE_BASE = 1 << 24      # keeps speculative steps' noise keys apart from token positions
LOAD_PLANS = 16                # decode plans the load a server carries is taken over (SpeculativeDecoding.in_lull)


@dataclass
class SpecRecord:
    """Speculative decoding's record of one request (Request.decode)."""
    steps_launched: int = 0     # speculative steps launched: seeded noise keys (the KV bound depends on timing)
    draft_lag: int = 0          # positions its draft model has to catch up on
    draft_end: int = 0          # positions its draft model has read (prefill; plain decodes); behind: to a hole
    drafting: int = 0           # speculative steps with drafts in flight (kv_len is a bound while > 0)
    extra_rounds: int = 0       # rounds (plain run steps) in flight beyond one a launch (each emits a token or more)
    plain: bool = False         # its last step was a plain decode (feed_plain: under load, or the gate's)
    behind: bool = False        # its draft skipped positions it cannot read later: it decodes plainly to its end
    verify_steps: int = 0       # steps that produced output for it while decoding
    unread_prefix: int = 0      # cached positions a draft that reads tokens has yet to get (on_cached)


class SpeculativeDecoding(DecodePolicy):
    def __init__(self, spec_tokens: int, off_batch_size: int = 0, draft_catches_up: bool = False, rounds: int = 1,
                 budget: LaunchBudget | None = None, gate: SpecGate | None = None, draft_falls_behind: bool = False,
                 arrivals: Arrivals | None = None, draft_reads_tokens: bool = False):
        self.spec_tokens = spec_tokens          # k+1 positions per speculative step
        self.rounds = rounds                    # most steps a launch (--num-scheduler-steps)
        self.budget = budget or LaunchBudget(0)     # and those that fit in --max-launch-ms
        self.growth = spec_tokens * rounds      # KV positions one decode launch may add
        self.off_batch_size = off_batch_size    # decode batches this large draft nothing (0: always draft)
        self.catches_up = draft_catches_up      # the draft can skip prefill chunks and read them later
        self.falls_behind = draft_falls_behind  # it can skip them for good (an EAGLE head): see `aside`
        self.reads_tokens = draft_reads_tokens  # it drafts from the request's tokens (n-gram): see `on_cached`
        self.gate = gate                        # --speculative-adaptive (None: off)
        self.arrivals = arrivals or Arrivals()  # prompts queued: a greedy launch of rounds yields to them
        self.load: deque[int] = deque(maxlen=LOAD_PLANS)    # requests running at each recent decode plan
        self.idle_arrival = False               # the last prompt found no request running
        self.off_steps = 0                      # decode steps without speculation (under load)
        self.gate_steps = 0                     # decode steps without speculation (the gate's choice)
        self.plain_now: str | None = None       # why its decodes go plain: "load", "gate", "behind", "lull", or None
        self.aside_now = False                  # this step's batch is not read by the draft: its requests fall behind
        self.held = 0                           # greedy speculating decodes waiting for this step's prompts

    @property
    def k(self) -> int:
        return self.spec_tokens - 1

    def new_record(self) -> SpecRecord:
        return SpecRecord()

    def new_plan(self) -> SpecPlan:
        return SpecPlan()

    def on_arrival(self, idle: bool) -> None:
        """Two prompts in a row that found no request running: the server serves one at a time, and the
        load it carried before is over (one such prompt is also how each wave of a steady load starts)."""
        self.arrivals.arrived()
        if idle and self.idle_arrival:
            self.load.clear()
        self.idle_arrival = idle

    def is_decoding(self, req: Request) -> bool:
        return req.prefilled                 # its last chunk is launched: the device holds its spec state

    def decodes_now(self, sched: "Scheduler", decodes: list[Request]) -> bool:
        """Speculative decodes wait for a prefill batch; plain ones join it. Decides for the step
        whether its decodes go plain (plan_decodes keeps that)."""
        wanting = self.wanting(sched, decodes)
        self.load.append(len(sched.running))
        self.plain_now = self.plain_reason(wanting, queued=bool(sched.waiting))
        self.aside_now = self.aside(wanting)
        now = not sched.prefill_ready() or self.plain_now is not None
        self.held = len(wanting) if not now and self.gated(wanting) else 0
        return now

    def wanting(self, sched: "Scheduler", decodes: list[Request]) -> list[Request]:
        """The decodes that can still emit a token (the rest finish with a step in flight)."""
        return [r for r in decodes if self.tokens_wanted(sched, r) > 0]

    def under_load(self, decodes: list[Request]) -> bool:
        """Speculation is off: as many decoding requests as --speculative-disable-by-batch-size."""
        return self.off_batch_size > 0 and len(decodes) >= self.off_batch_size

    def plain_reason(self, decodes: list[Request], queued: bool) -> str | None:
        """Why these decodes go without speculation: "load" (the fixed rule, which overrides the
        gate), "behind" (one of them can no longer draft), "gate" (an all-greedy batch the gate
        expects speculation to lose on), or None."""
        if self.under_load(decodes):
            return "load"
        if not self.gated(decodes):           # sampling batches keep speculating (a row behind drafts poorly)
            return None
        if any(r.decode.behind for r in decodes):
            return "behind"
        if self.in_lull(len(decodes)):
            return "lull"
        return None if self.gate.speculate(len(decodes), queued) else "gate"

    def busiest(self, rows: int) -> int:
        """The most requests running at a decode plan among the last LOAD_PLANS (on_arrival: since when)."""
        return max(rows, max(self.load, default=0))

    def in_lull(self, rows: int) -> bool:
        """Are `rows` fewer than the load the server carries, whose batch size the gate has settled on plain?
        Under a steady load a batch dips for a launch or two (some requests ended, their successors' prompts
        are on the way): a request that speculated alone there would run ahead of the others, and the load's
        batches, which decode plainly, would be out of step for the rest of their requests (at concurrency 4,
        more time at 1 and 3 rows, less at 4). The dip decodes as the load's batch size chose, and teaches
        the gate nothing: its bucket's estimates stay those of a server that carries that few."""
        busiest = self.busiest(rows)
        return bucket_of(busiest) != bucket_of(rows) and self.gate.settled_plain(busiest)

    def aside(self, decodes: list[Request]) -> bool:
        """Does speculation step aside for good for these decodes: the draft does not read their plain
        steps (nor the prompts that join them), so they decode as fast as without a draft but never draft
        again? For a draft that cannot catch up (an EAGLE head: what it reads are the target's features of
        the step), once the gate has settled on plain decoding at their batch size (SpecGate.settled_plain),
        or once one of them is behind already. Keeping the head current costs its pass over every plain
        step, which is what the gate's choice was to save. Greedy prompts that arrive while their batch size
        is settled on plain are not read either (SpecGate.skip_prompts), except when it explores:
        its requests explore speculation. A batch with a sampling prompt in it is read."""
        if not self.falls_behind or self.plain_now not in ("gate", "behind", "lull"):
            return False
        return self.plain_now in ("behind", "lull") or self.gate.settled_plain(len(decodes))

    def gated(self, decodes: list[Request]) -> bool:
        """The gate decides for (and learns from) all-greedy batches only (spec/gate.py)."""
        return self.gate is not None and bool(decodes) and all(r.params.greedy for r in decodes)

    # ---- decode steps ----------------------------------------------------------------

    def plan_decodes(self, sched: "Scheduler", batch: ScheduledBatch, decodes: list[Request]) -> bool:
        decodes = self.wanting(sched, decodes)
        if not decodes:
            return False
        most_wanted = max(self.tokens_wanted(sched, req) for req in decodes)
        if self.plain_now and not any(r.decode.drafting for r in decodes):
            return self.plan_plain(sched, batch, decodes, most_wanted)
        batch.spec.decode = True
        batch.spec.chain = self.chain_length(decodes, most_wanted)
        batch.steps = self.batch_rounds(sched, decodes, batch.chain, most_wanted)
        if batch.steps > 1 and all(r.params.greedy for r in decodes):       # spec/arrivals.py
            batch.spec.yield_at = self.arrivals.count
        if batch.chain and self.gated(decodes):
            self.gate.fed(len(decodes), speculative=True)
            batch.spec.gate_rows = len(decodes)
        for req in decodes:
            self.feed_spec(sched, batch, req)
        return True

    def gate_chose_plain(self, decodes: list[Request]) -> bool:
        """Is this plain launch the gate's mode for its batch size: the gate chose it, or the batch has
        requests behind where the gate has settled on plain anyway? Such a launch counts towards the
        bucket's next exploration and is charged to plain as it runs: a run the head skips (`aside`) is
        what plain decoding costs once settled, and what speculation must beat to come back."""
        if self.plain_now == "gate":
            return True
        return self.plain_now == "behind" and self.gated(decodes) and self.gate.settled_plain(len(decodes))

    def plan_plain(self, sched: "Scheduler", batch: ScheduledBatch, decodes: list[Request], most_wanted: int) -> bool:
        """Decodes without speculation: one token each with prompt chunks, or, when no prompt is
        waiting, a run of up to `rounds` steps (True: the batch is complete)."""
        steps = 1 if self.rounds < 2 or sched.prefill_ready() else self.plain_run_steps(sched, decodes, most_wanted)
        self.count_plain(steps)
        if self.gate_chose_plain(decodes):
            self.gate.fed(len(decodes), speculative=False)
            batch.spec.gate_rows = len(decodes)
        if steps == 1:
            for req in decodes:
                self.feed_plain(sched, batch, req)                   # prompt chunks may join
            return False
        batch.steps = steps
        for req in decodes:
            self.feed_plain_run(sched, batch, req, steps)
        self.end_prefill_plan(sched, batch)
        return True

    def plain_run_steps(self, sched: "Scheduler", decodes: list[Request], most_wanted: int) -> int:
        """Steps of a plain run (as engine/multi_step.py plans them): what fits in the launch budget,
        no more than any request can use, never a position past the context."""
        room = min(sched.config.context_length - req.kv_len for req in decodes)
        return max(1, min(self.rounds, self.budget.steps(len(decodes), 0), most_wanted, room))

    def count_plain(self, steps: int) -> None:
        if self.plain_now in ("gate", "behind", "lull"):
            self.gate_steps += steps
        else:
            self.off_steps += steps

    def tokens_wanted(self, sched: "Scheduler", req: Request) -> int:
        """Most tokens the request can still emit, given that every step in flight emits at least one."""
        return sched.tokens_left(req) - req.pending - req.decode.extra_rounds

    def batch_rounds(self, sched: "Scheduler", decodes: list[Request], chain: int, most_wanted: int) -> int:
        """Speculative steps of the launch: up to `rounds` for a drafting batch (no prompt is waiting:
        plan_decodes runs only then) and what fits in the launch budget, no more than its requests
        can use (each round emits at least one token), never a position past the context, and no
        more than the request likely to end first is likely to use (rounds_likely): a row whose
        request ended costs a round as much as a live one (all k+1 positions are verified), so the
        launch ends where its first request likely does and the next launch goes without it
        (docs/performance-history.md: "A speculative launch ends where its first request likely ends")."""
        if self.rounds < 2 or chain == 0:
            return 1
        room = min(sched.config.context_length - req.kv_len for req in decodes) // (chain + 1)
        likely = min(self.rounds_likely(sched, req) for req in decodes)
        return max(1, min(self.rounds, self.budget.steps(len(decodes), chain), most_wanted, likely, room))

    def rounds_likely(self, sched: "Scheduler", req: Request) -> int:
        """Rounds the request is likely to use: what it can still emit, less what its rounds in
        flight are likely to emit, at the mean run a round emitted for it so far. A round past its
        end only holds up the batch behind (a launch planned on the one in flight, with overlap,
        cannot know that the request ends in it): such a launch gets one round, as without rounds."""
        record = req.decode
        run = max(1.0, (len(req.output_ids) - 1) / record.verify_steps) if record.verify_steps else 1.0
        return max(1, math.ceil(sched.tokens_left(req) / run - req.pending - record.extra_rounds))

    def chain_length(self, decodes: list[Request], most_wanted: int) -> int:
        """Draft tokens per request: none when its decodes go plain and, for an all-greedy batch, never more than
        its requests can still use (most_wanted: the largest tokens_wanted among them).
        The cap depends on timing (what was processed when), so it is kept from sampling batches:
        a seeded request must see the same chain lengths in every run."""
        if self.plain_now:                  # a drafting step is in flight: this one drafts nothing
            self.count_plain(1)
            return 0
        if not all(r.params.greedy for r in decodes):
            return self.k
        return max(0, min(self.k, most_wanted - 1))

    def feed_spec(self, sched: "Scheduler", batch: ScheduledBatch, req: Request) -> None:
        """One speculative step, or batch.steps of them: chain+1 positions each, starting where the
        device says. Round i of a launch samples with the noise key of the request's next step + i."""
        chain, record, rounds = batch.spec.chain, req.decode, batch.steps
        size = (chain + 1) * rounds
        sched.allocate(batch, req, req.kv_len + size)
        first_key = SPEC_NOISE_BASE + record.steps_launched + 1
        record.steps_launched += rounds
        record.extra_rounds += rounds - 1
        seq = SeqWork(req=req, row=req.row, start=req.kv_len, q_len=size, decode=True, noise_key=first_key)
        seq.future_id = req.future_id = sched.take_future()      # its last emitted token: a plain decode's input
        batch.seqs.append(seq)
        batch.spec.draft_lag.append(record.draft_lag)
        batch.spec.length_cap.append(min(len(req.input_ids) + req.params.max_new_tokens, sched.config.context_length))
        record.draft_lag = record.draft_lag + 1 if chain == 0 else 0
        record.drafting += chain > 0
        record.plain = False
        batch.sample_params.append(req.params)
        req.kv_len += size
        req.pending += 1

    def feed_plain(self, sched: "Scheduler", batch: ScheduledBatch, req: Request) -> None:
        """A decode as without speculation (kv_len is exact: no drafting step in flight). Coming
        from speculative steps, the draft has read the positions before kv_len - 1 - draft_lag;
        end_prefill_plan counts what it lacks from there."""
        record = req.decode
        if not record.plain and not record.behind:      # a head behind read nothing past its draft_end
            record.draft_end = req.kv_len - 1 - record.draft_lag
        record.plain = True
        sched.feed(batch, req, 1, decode=True)

    def feed_plain_run(self, sched: "Scheduler", batch: ScheduledBatch, req: Request, steps: int) -> None:
        """`steps` plain decodes back to back: one token fed as feed_plain feeds it (its noise key is
        the first step's), the steps after it take the next positions; kv_len stays exact."""
        self.feed_plain(sched, batch, req)
        sched.allocate(batch, req, req.kv_len + steps - 1)
        req.kv_len += steps - 1
        req.decode.extra_rounds += steps - 1

    # ---- prefill batches -------------------------------------------------------------

    def cacheable(self, req: Request) -> int:
        """A cached page carries the draft's K/V, which must be what the draft would have computed (a
        seeded request's tokens depend on the drafts): only positions the draft read go to the cache. A
        draft behind read up to draft_end; one that lags (a standalone draft after plain steps) lacks its
        last draft_lag positions."""
        record = req.decode
        if record.behind:
            return min(req.written, record.draft_end)
        return min(req.written, req.known_len - 1 - record.draft_lag)

    def on_cached(self, req: Request, length: int) -> None:
        """The cached pages hold the draft's K/V too (same slots): its draft has read them. (Where the
        request that left them had skipped some, its drafts there are poorer, never wrong: the verify
        decides.) A draft that reads the request's tokens keeps them per row, not per slot: the row holds
        what its last request left there, so the first chunk brings the cached tokens along (on_fed)."""
        req.decode.draft_end = length
        if self.reads_tokens:
            req.decode.unread_prefix = length

    def on_fed(self, batch: ScheduledBatch, seq: SeqWork) -> None:
        """The draft reads token t+1 at position t; a last chunk's is sampled."""
        end = seq.start + seq.q_len
        batch.spec.draft_next.append(-1 if seq.last_chunk else seq.req.all_ids[end])
        record = seq.req.decode
        if record.unread_prefix:
            batch.spec.cached_tokens.append((seq.row, seq.req.all_ids[:record.unread_prefix]))
            record.unread_prefix = 0

    def end_prefill_plan(self, sched: "Scheduler", batch: ScheduledBatch) -> None:
        """Does the draft model read this prefill batch, and how far each request's draft lags."""
        off = self.off_batch_size
        skip = self.catches_up and (self.plain_now is not None or 0 < off <= len(sched.running)
                                    or any(seq.req.decode.draft_end < seq.start for seq in batch.seqs))
        aside = self.falls_behind and all(seq.req.params.greedy for seq in batch.seqs) and (
            self.aside_now or self.plain_now is None and self.gate is not None
            and self.gate.skip_prompts(self.busiest(len(sched.running))))
        batch.spec.draft_skip = skip or aside
        if self.held:                        # speculative decodes wait for this batch: a cost of speculating
            batch.spec.gate_rows, self.held = self.held, 0
        if aside:
            for seq in batch.seqs:
                seq.req.decode.behind = True
        # Requests that end with their first token (max_tokens 1, not exported) never get a decode
        # step (tokens_wanted is 0 once the prefill is in flight): the draft's pass over their prompts
        # would only hold up the batch behind.
        batch.spec.no_decode = all(seq.req.params.max_new_tokens <= 1 and not seq.req.exported for seq in batch.seqs)
        for seq in batch.seqs:
            record, end = seq.req.decode, seq.req.kv_len       # a plain run's end, past its one fed token
            if batch.spec.no_decode:        # the draft reads none of it, and never will: keep it out of the cache
                record.behind, record.draft_end = True, min(record.draft_end, seq.start)
            elif not batch.spec.draft_skip and not record.behind:
                record.draft_end = end      # (a head behind has holes from draft_end on: what it reads later stays out)
            if seq.last_chunk:
                record.draft_lag = 0 if record.draft_end == end else end - 1 - record.draft_end

    # ---- results -----------------------------------------------------------------------

    def on_output(self, sched: "Scheduler", batch: ScheduledBatch, seq: SeqWork, run: list[int], rounds: int) -> None:
        req = seq.req
        if seq.decode:                       # a plain decode counts as a one-token verify
            req.decode.verify_steps += rounds
        req.decode.extra_rounds -= batch.steps - 1          # a plain run's steps too
        if batch.is_spec_decode:
            req.decode.drafting -= batch.chain > 0
            if req.status is Status.RUNNING:
                sched.give_back(req, seq.q_len - len(run))

    def on_void(self, batch: ScheduledBatch, seq: SeqWork) -> None:
        seq.req.decode.extra_rounds -= batch.steps - 1
        if batch.is_spec_decode:
            seq.req.decode.drafting -= batch.chain > 0

    def observe_launch(self, batch: ScheduledBatch, seconds: float, rounds: int,
                       output: StepOutput | None = None, cycle: float | None = None) -> None:
        """Speculative launches and plain runs teach the launch budget their size's time; the gate
        learns from the launches it chose a mode for (SpecPlan.gate_rows), by their cycle."""
        speculative = batch.is_spec_decode and batch.chain > 0
        plain = not batch.is_spec_decode and bool(batch.seqs) and all(seq.decode for seq in batch.seqs)
        if speculative or plain:
            self.budget.observe(len(batch.seqs), batch.chain, rounds, seconds)
        rows, cycle = batch.spec.gate_rows, cycle or seconds     # a cycle holds its span
        if self.gate is None or not rows:
            return
        if speculative:
            tokens = sum(len(run) for run in output.tokens) if output else 0
            if tokens and not self.yielded(batch, rounds):
                self.gate.observe(rows, True, cycle, rounds, tokens)
        elif batch.is_spec_decode:
            return                       # a chain-0 step: a one-off on the way to plain steps
        elif any(seq.decode for seq in batch.seqs):
            self.gate.observe(rows, False, cycle, rounds, beside_prompts=not plain)
        else:
            self.gate.waited(rows, cycle)

    def yielded(self, batch: ScheduledBatch, rounds: int) -> bool:
        """Did the launch end its rounds early for a prompt that arrived (spec/arrivals.py)? The gate is not
        charged with it: what its length measures is when the prompt came, and the mode it is compared
        with runs its launch whole while the prompt waits (a plain run does not yield). The host does not
        know why the stream stopped: a launch whose rows all ended while a prompt arrived reads as yielded
        too, and goes uncharged (a request's last launch; its rounds were none the slower)."""
        return rounds < batch.steps and self.arrivals.since(batch.spec.yield_at)

    def on_retract(self, req: Request) -> None:
        req.decode.draft_lag = req.decode.draft_end = 0
        req.decode.plain = req.decode.behind = False      # its recompute is read again

    def verify_steps(self, req: Request) -> int:
        return req.decode.verify_steps

    def export_record(self, req: Request) -> dict:
        if req.decode.drafting:
            raise ValueError(f"request {req.rid} has a drafting step in flight")
        return dataclasses.asdict(req.decode)

    def import_record(self, req: Request, record: dict) -> None:
        req.decode = SpecRecord(**record)
