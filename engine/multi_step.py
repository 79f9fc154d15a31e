"""Multi-step plain decoding (--num-scheduler-steps N), CPU side: when no prompt is waiting,
a batch of decodes runs up to N decode steps in one launch, each row feeding the token it
sampled last (engine/model_runner.py: ModelRunner.decode_steps). The rank loop, the front and
the client then do their per-step work once per N tokens; on a CPU, where that work shares
the cores with the forward, it is most of what one request at a time pays above the forward.

A multi-step batch feeds each request one token (its future, or its last known token) and
takes N positions of KV; each row advances exactly N positions, so kv_len stays exact. Its
rows sample with the noise keys plain steps would use (position after position), so seeded
and greedy outputs are those of plain decoding. A row that finishes inside the run (EOS, a
stop token, max_tokens, the context) drops the tokens after it: Scheduler.append_run cuts the
run there, and finishing frees its KV as for any request (the batch behind it writes only into
its own, freed slots).

Whenever a prompt can make progress (Scheduler.prefill_ready) the decodes go one token each, in
the same batch as the prompt chunks, as plain decoding does: a new prompt waits at most for the
multi-step launch in flight, which runs only as many steps as fit in --max-launch-ms
(engine/launch_budget.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.batch import ScheduledBatch, SeqWork, StepOutput
from engine.launch_budget import LaunchBudget
from engine.policy import DecodePolicy
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


@dataclass
class MultiStepRecord:
    """Multi-step decoding's record of one request (Request.decode)."""
    extra_in_flight: int = 0    # tokens in flight beyond one per launched step (N - 1 per multi-step batch)


class MultiStepDecoding(DecodePolicy):
    def __init__(self, steps: int, budget: LaunchBudget | None = None):
        self.steps = steps
        self.budget = budget or LaunchBudget(0)     # the steps that fit in --max-launch-ms
        self.growth = steps                  # KV positions one decode step may add (reservations, make_room_for)

    def new_record(self) -> MultiStepRecord:
        return MultiStepRecord()

    def plan_decodes(self, sched: "Scheduler", batch: ScheduledBatch, decodes: list[Request]) -> bool:
        decodes = [r for r in decodes if self.tokens_wanted(sched, r) > 0]    # the rest finish with a step in flight
        steps = 0 if sched.prefill_ready() else self.batch_steps(sched, decodes)
        if steps < 2:
            return super().plan_decodes(sched, batch, decodes)      # one token each; prompt chunks join
        batch.steps = steps
        for req in decodes:
            self.feed_steps(sched, batch, req, steps)
        return True

    def batch_steps(self, sched: "Scheduler", decodes: list[Request]) -> int:
        """Steps of the next batch: at most N and what fits in the launch budget, no more than any
        of its requests can still emit, and never past a request's context (its KV positions must
        exist)."""
        wanted = [self.tokens_wanted(sched, req) for req in decodes]
        if not wanted or max(wanted) < 2:
            return 0
        room = min(sched.config.context_length - req.kv_len for req in decodes)
        return min(self.steps, self.budget.steps(len(decodes)), max(wanted), room)

    def tokens_wanted(self, sched: "Scheduler", req: Request) -> int:
        """Tokens the request can still emit beyond those in flight (every launched step emits one,
        a multi-step batch N unless the request finishes inside it)."""
        return sched.tokens_left(req) - req.pending - req.decode.extra_in_flight

    def feed_steps(self, sched: "Scheduler", batch: ScheduledBatch, req: Request, steps: int) -> None:
        """One token fed as a plain decode would be (its noise key is the first step's); the steps
        after it take the next steps - 1 positions."""
        sched.feed(batch, req, 1, decode=True)
        sched.allocate(batch, req, req.kv_len + steps - 1)
        req.kv_len += steps - 1
        req.decode.extra_in_flight += steps - 1

    def on_output(self, sched: "Scheduler", batch: ScheduledBatch, seq: SeqWork, run: list[int], rounds: int) -> None:
        seq.req.decode.extra_in_flight -= batch.steps - 1

    def on_void(self, batch: ScheduledBatch, seq: SeqWork) -> None:
        seq.req.decode.extra_in_flight -= batch.steps - 1

    def observe_launch(self, batch: ScheduledBatch, seconds: float, rounds: int,
                       output: StepOutput | None = None, cycle: float | None = None) -> None:
        if batch.seqs and all(seq.decode for seq in batch.seqs):       # decodes alone: no prompt chunk in it
            self.budget.observe(len(batch.seqs), 0, rounds, seconds)
