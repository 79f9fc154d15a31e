"""The engine core of a rank: schedule, launch, process — the same steps with and without overlap.

    launched = launch(schedule())     # batch N+1, queued on the device stream; returns at once
    await finish(in_flight)           # batch N: outputs -> requests
    in_flight = launched              # (without overlap: finish(launched) right away)

A step that fails (its work raised on the stream, the device reported an error, or preparing or
processing it raised) ends only its own requests, with an error; everything they held is freed.
The batch launched behind it is re-planned around them: their rows in it read the failed
step's outputs and are dropped when it is processed (they are finished), while its other rows
never depended on the failed step (each request's inputs come from its own earlier steps, its
own KV slots and per-row device state), so their work stands and their output, seeded sampling
included, is what it would have been. The rows of the failed requests in it still run: the
failed step's bookkeeping (its slot-table entries, its prompts' decode lengths) landed anyway
(ModelRunner.launch), so they write only into their own, freed slots, and nothing in them can
make the step raise for its other rows.

When the deferred part of a step fails (devices/base.py: Deferred), the next launch reports it
without having run: the step whose deferred part failed is at fault, and the launch that did not
run and the batch behind it are voided: their outputs are dropped and their other requests go
back to recompute from what is known, as a retraction does (their device state is re-seeded by
their next prefill). After MAX_CONSECUTIVE_FAILURES failed steps in a row the device itself is
suspect: EngineBroken ends the rank, and the front starts a new one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from devices.base import DeferredWorkFailed, Launched
from engine.dp import DpGroup, GroupBroken, StepPlan
from engine.graph_shape import GraphShape
from engine.model_runner import ModelRunner
from engine.messages import SamplingParams
from engine.request import Request, Status
from engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from engine.stats import Stat, counter
from engine.step import RequestState, StepResult
from engine.trace import OverlapMeter, Tracer

log = logging.getLogger(__name__)
MAX_CONSECUTIVE_FAILURES = 3


class EngineBroken(RuntimeError):
    """Steps keep failing whatever they hold: the rank must be replaced."""


@dataclass
class InFlight:
    batch: ScheduledBatch
    launched: Launched
    void: bool = False          # its outputs are never applied (a step before it failed)


@dataclass
class Finished:
    """A processed step, for observers (the rank's accounting, tests)."""
    batch: ScheduledBatch
    launched: Launched
    result: StepResult
    output: StepOutput


def admissions(batch: ScheduledBatch) -> dict:
    """The trace's record of the requests a batch admitted: what each knew and how much of it the prefix
    cache held (none when it admitted none, to keep decode steps' spans short)."""
    if not batch.admitted:
        return {}
    return {"admitted": [{"rid": a.rid, "tokens": a.known, "cached": a.cached} for a in batch.admitted]}


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool, tracer: Tracer | None = None,
                 dp: DpGroup | None = None):
        self.scheduler, self.runner, self.overlap, self.dp = scheduler, runner, overlap, dp
        self.plan = StepPlan(run=True, stop=False)        # DP attention: what the group agreed last
        self.tracer = tracer or Tracer(None, 0)
        self.meter = OverlapMeter()
        self.in_flight: InFlight | None = None
        self.last_awaited: InFlight | None = None
        self.device_free_at = 0.0      # when the last launch awaited finished on the device
        self.last_cycle = 0.0          # that launch's cycle (account_device)
        self.observers: list[Callable[[Finished], None]] = []           # each processed step
        self.launch_observers: list[Callable[[InFlight], None]] = []    # each step, right after its launch
        self.failed_steps = 0
        self.consecutive_failures = 0
        self.broken: EngineBroken | None = None
        self.stalled = False

    @property
    def busy(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work

    def stats(self) -> list[Stat]:
        return [counter("tandem_failed_steps", "Launched steps that failed; only their requests got errors (since "
                        "the ranks started).", self.failed_steps)]

    async def step(self, stopping: bool = False) -> list[Request]:
        """One iteration; returns the requests with news for the front (outputs, or their end).
        With DP attention the group first agrees on the step (`stopping`: this rank wants to stop)."""
        if self.broken:
            raise self.broken
        launched = await self.schedule_and_launch(stopping)
        self.stalled = launched is None and self.in_flight is None      # nothing to run until something changes
        news: list[Request] = []
        if self.in_flight:
            news += await self.finish(self.in_flight, behind=launched)
        self.in_flight = launched
        if launched and not self.overlap:
            self.in_flight = None
            news += await self.finish(launched, behind=None)
        return news

    async def drain(self) -> list[Request]:
        """Finish the step in flight."""
        flight, self.in_flight = self.in_flight, None
        return await self.finish(flight, behind=None) if flight else []

    async def close(self) -> list[Request]:
        """At shutdown: finish the step in flight, then release the captured graphs (on the stream,
        behind everything that could replay them)."""
        news = await self.drain()
        await self.runner.device.launch(self.runner.release_graphs)
        return news

    # ---- a request's state, to continue elsewhere ----------------------------------------

    async def export_request(self, rid: str) -> RequestState:
        """A running request with nothing in flight (drain first): its KV and decoding state."""
        req = self.scheduler.requests[rid]
        if req.pending or req.status is not Status.RUNNING or not self.scheduler.policy.is_decoding(req):
            raise ValueError(f"request {rid} is not decoding at a step boundary")
        record = self.scheduler.policy.export_record(req)
        slots = self.scheduler.pool.slots(req.pages, 0, req.kv_len)
        target_kv, draft_kv, draft_row = await self.runner.device.launch(
            lambda: self.runner.export_chunk(req.row, slots))
        return RequestState(req.kv_len, target_kv, draft_kv, draft_row, record)

    async def import_request(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids: list[int],
                             state: RequestState) -> str | None:
        """Continue a request exported elsewhere; None, or why it cannot run here."""
        req, error = self.scheduler.admit_imported(rid, input_ids, params, output_ids, state.kv_len, state.record)
        if error:
            return error
        pool = self.scheduler.pool
        slots = pool.slots(req.pages, 0, len(req.pages) * pool.page_size)
        try:
            await self.runner.device.launch(lambda: self.runner.import_state(req.row, slots, state, req.all_ids))
        except Exception as exc:       # a malformed state fails this request alone
            self.scheduler.fail(req, f"import failed: {exc}")
            return f"import failed: {exc}"
        return None

    # ---- launch ----------------------------------------------------------------------

    async def schedule_and_launch(self, stopping: bool) -> InFlight | None:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        scheduled = time.perf_counter()
        graph = self.runner.graph_shape(batch)
        if self.dp is not None:
            batch = await self.agree(batch, stopping, graph)
            graph = self.plan.graph
            scheduled = time.perf_counter()
        if batch is None:
            self.meter.cpu(start, scheduled)
            return None
        flight = self.launch_idle(batch, graph) if batch.idle else InFlight(batch, self.launch(batch, graph))
        for observe in self.launch_observers:
            observe(flight)
        end = time.perf_counter()
        self.meter.cpu(start, end)
        self.tracer.span("schedule", f"schedule {batch.step}", start, scheduled, seqs=len(batch.seqs),
                         tokens=batch.num_tokens, **admissions(batch))
        self.tracer.span("launch", f"launch {batch.step}", scheduled, end)
        return flight

    async def agree(self, batch: ScheduledBatch | None, stopping: bool,
                    graph: GraphShape | None) -> ScheduledBatch | None:
        """DP attention: exchange with the group (in a thread: the loop goes on meanwhile); when
        another rank has a batch and this one has none, an idle batch keeps the collectives in step.
        `graph`: what this rank's batch could replay; the plan says what the group replays."""
        start = time.perf_counter()
        self.plan = await asyncio.to_thread(self.dp.agree, batch is not None, stopping, graph)
        self.tracer.span("schedule", "sync", start, time.perf_counter())
        if batch is None and self.plan.run:
            self.dp.counters.idle_steps += 1
            return ScheduledBatch(step=self.scheduler.step, seqs=[], input_ids=[], idle=True)
        return batch

    def launch_idle(self, batch: ScheduledBatch, graph: GraphShape | None) -> InFlight:
        runner = self.runner
        return InFlight(batch, runner.device.launch(lambda: runner.idle_step(decode=False, graph=graph)))

    def launch(self, batch: ScheduledBatch, graph: GraphShape | None) -> Launched:
        """The batch on the device stream; an error while preparing it fails it like a device error."""
        try:
            return self.runner.launch(batch, graph)
        except Exception as exc:       # delivered to whoever awaits the launch
            return Launched.failed(exc)

    # ---- finish ----------------------------------------------------------------------

    async def finish(self, flight: InFlight, behind: InFlight | None) -> list[Request]:
        try:
            result = await flight.launched
        except GroupBroken:
            raise                      # the group is gone: this rank cannot go on alone
        except Exception as exc:       # the step failed: isolate it
            return self.step_failed(flight, exc, behind)
        finally:
            self.account_device(flight)
        self.last_awaited = flight
        if flight.void or flight.batch.idle:
            return []
        start = time.perf_counter()
        try:
            output = result.output()
            self.scheduler.policy.observe_launch(
                flight.batch, flight.launched.finished - flight.launched.started,
                len(result.rounds) if result.rounds is not None else flight.batch.steps, output,
                cycle=self.last_cycle)
            news = self.scheduler.process(flight.batch, output)
        except Exception as exc:       # a bug on the CPU side: the batch fails alone
            return self.step_failed(flight, exc, behind)
        self.consecutive_failures = 0
        for observe in self.observers:
            observe(Finished(flight.batch, flight.launched, result, output))
        end = time.perf_counter()
        self.meter.cpu(start, end)
        self.tracer.span("process", f"process {flight.batch.step}", start, end)
        return news

    def account_device(self, flight: InFlight) -> None:
        """Device time, and the launch's cycle: from the previous launch's end on the device to this one's.
        Launches follow each other on the device, so a cycle longer than the launch's own span is time the
        device waited for the loop to prepare it: what a decoding mode costs the server, not just the device."""
        launched = flight.launched
        if launched.finished:
            span = launched.finished - launched.started
            since = launched.finished - self.device_free_at if self.device_free_at else span
            self.last_cycle, self.device_free_at = max(span, since), launched.finished
            self.meter.device(launched.started, launched.finished)
            self.tracer.span("device", f"forward {flight.batch.step}", launched.started, launched.finished,
                             tokens=flight.batch.num_tokens)

    def step_failed(self, flight: InFlight, exc: Exception, behind: InFlight | None) -> list[Request]:
        """Fail the requests of the step at fault; void what was planned on work that never ran."""
        deferred = isinstance(exc, DeferredWorkFailed)          # the previous step's deferred part failed
        culprit = self.last_awaited if deferred else flight
        self.last_awaited = flight
        news = [] if culprit is None or culprit.void else \
            [seq.req for seq in culprit.batch.seqs if not seq.req.finished]
        if not news and not deferred:       # planned on a failed step, or voided: no one is waiting for it
            log.warning("step %d failed too, with no request left in it: %r", flight.batch.step, exc)
            return []
        self.failed_steps += 1
        self.consecutive_failures += 1
        log.error("step %d failed: %r", culprit.batch.step if culprit else flight.batch.step, exc, exc_info=exc)
        for req in news:
            self.scheduler.fail(req, f"step {culprit.batch.step} failed: {exc}")
        if deferred and not flight.void:        # its work never ran, and the batch behind was planned on it
            for voided in (flight, behind):
                if voided is not None and not voided.void:
                    voided.void = True
                    self.scheduler.void(voided.batch)
        if self.dp is not None:        # its forward may have missed the group's collectives: out of step
            self.broken = EngineBroken(f"a step failed under DP attention ({exc!r}); the group restarts")
        if self.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:     # raised by the next step(), after this news
            self.broken = EngineBroken(f"{self.consecutive_failures} steps in a row failed; the last: {exc!r}")
        return list({id(req): req for req in news}.values())
