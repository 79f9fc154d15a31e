"""How decoding requests are stepped: the decode policy (CPU side, pure Python).

The scheduler decides what runs in a step: which requests, admission, prompt chunks, KV pages,
retraction. The policy says how its decoding requests are fed and what a processed step means
for them, and keeps its own record of each request (`Request.decode`):

  PlainDecoding            one token per decode, in the same batch as prompt chunks
  SpeculativeDecoding      a draft/verify run per decode (spec/policy.py); plain decodes under load

Each policy has a device-side counterpart that runs its steps and makes the policy (engine/
decoding.py: a Decoding): the plain decoder for plain decoding, a speculative worker
(spec/*_worker.py) for speculation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.batch import DecodePlan, ScheduledBatch, SeqWork, StepOutput
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class DecodePolicy:
    """Plain decoding's answers; speculative decoding overrides what differs."""

    growth = 1                  # KV positions one decode step may add to a request
    off_steps = 0               # decode steps scheduled without speculation although it is on (under load)
    gate_steps = 0              # decode steps scheduled without speculation because its gate chose so
    gate = None                 # speculation's adaptive gate (spec/gate.py), where it is on

    def new_record(self) -> object:
        """The policy's record of a new request (Request.decode)."""
        return None

    def new_plan(self) -> "DecodePlan | None":
        """What the policy adds to a new batch (ScheduledBatch.spec; its decoding reads it: Decoding.plan_inputs)."""
        return None

    def on_arrival(self, idle: bool) -> None:
        """A prompt joined the queue (it waits for whatever launch is in flight); idle: no request was running."""

    def is_decoding(self, req: Request) -> bool:
        """Past its prompt: fed one token (or one speculative run) per step."""
        return req.kv_len >= req.known_len - 1

    def decodes_now(self, sched: "Scheduler", decodes: list[Request]) -> bool:
        """Schedule the decodes in this step (False: a prefill batch goes first)."""
        return True

    def plan_decodes(self, sched: "Scheduler", batch: ScheduledBatch, decodes: list[Request]) -> bool:
        """Feed the decodes into `batch`; True when the batch is complete (prompt chunks do not join)."""
        for req in decodes:
            sched.feed(batch, req, 1, decode=True)
        return False

    def cacheable(self, req: Request) -> int:
        """Positions of the request whose K/V (the draft's too, where there is one) may go to the prefix
        cache: those processed steps wrote (engine/radix_cache.py)."""
        return req.written

    def on_cached(self, req: Request, length: int) -> None:
        """An admitted request found positions [0, length) in the prefix cache: its prefill starts there."""

    def on_fed(self, batch: ScheduledBatch, seq: SeqWork) -> None:
        """A prompt chunk (or a decode scheduled as one) was fed into a prefill batch."""

    def end_prefill_plan(self, sched: "Scheduler", batch: ScheduledBatch) -> None:
        """The prefill batch is complete."""

    def on_output(self, sched: "Scheduler", batch: ScheduledBatch, seq: SeqWork, run: list[int], rounds: int) -> None:
        """A processed sampling sequence emitted `run` (before its tokens are appended) over `rounds` steps
        (batch.steps, or fewer where a multi-round launch ended early)."""

    def on_void(self, batch: ScheduledBatch, seq: SeqWork) -> None:
        """A sampling sequence of a voided batch: its output will never be processed."""

    def observe_launch(self, batch: ScheduledBatch, seconds: float, rounds: int,
                       output: StepOutput | None = None, cycle: float | None = None) -> None:
        """A launched batch ran `rounds` steps in `seconds` of device time and produced `output`;
        `cycle`: the wall time it held the device's turn, the loop's part included where the device waited
        for it (engine/core.py). engine/launch_budget.py learns from the device time, spec/gate.py from
        the cycle."""

    def on_retract(self, req: Request) -> None:
        """The request lost its KV and will recompute from its prompt and outputs."""

    def verify_steps(self, req: Request) -> int:
        """Steps that produced output for it while decoding (SGLang's spec_verify_ct); 0 without speculation."""
        return 0

    def export_record(self, req: Request) -> dict:
        """The request's record as plain data, for it to continue under another scheduler."""
        return {}

    def import_record(self, req: Request, record: dict) -> None:
        """Continue a request exported elsewhere (its KV and device state come separately)."""


class PlainDecoding(DecodePolicy):
    """One token per decode step; decodes share batches with prompt chunks."""
