"""One DP rank: a coroutine loop that overlaps CPU scheduling of batch N+1 with
device execution of batch N.

    batch = schedule()            # CPU: pick requests, allocate KV, build inputs
    launched = launch(batch)      # queue it on the device stream; returns at once
    await finish(in_flight)       # the previous batch: outputs -> requests -> front
    in_flight = launched

`--disable-overlap-schedule` runs the same steps without the lag.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from devices.base import Device, Launched
from engine.args import ServerArgs
from engine.messages import AbortRequest, AddRequest, RankStats, RequestRejected, Shutdown, TokenDelta
from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.trace import OverlapMeter, Tracer
from engine.wire import Channel

log = logging.getLogger(__name__)
STATS_INTERVAL = 0.5
LOG_INTERVAL = 10.0


@dataclass
class InFlight:
    batch: ScheduledBatch
    launched: Launched


class Rank:
    def __init__(self, args: ServerArgs, rank: int, device: Device, channel: Channel, eos_ids: frozenset[int]):
        self.args, self.rank, self.device, self.channel = args, rank, device, channel
        future_slots = 2 * args.max_running_requests + 2        # two batches of outputs in flight
        self.runner = ModelRunner(args, device, future_slots)
        self.pool = KVPool(self.runner.num_slots, args.page_size, self.runner.num_rows)
        self.scheduler = Scheduler(SchedulerConfig(
            max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
            max_prefill_tokens=args.max_prefill_tokens, chunked_prefill_size=args.chunked_prefill_size,
            context_length=self.runner.context_length, future_slots=future_slots,
            spec_tokens=self.runner.spec_tokens, spec_off_batch_size=args.spec_off_batch_size,
            draft_skips_prefill=self.runner.draft_skips_prefill), self.pool, eos_ids)
        self.inbox: list = []
        self.wake = asyncio.Event()
        self.stopping = False
        self.tracer = Tracer(args.trace_file, rank)
        self.overlap = OverlapMeter()
        self.generated = 0
        self.accept_hist = [0] * self.runner.spec_tokens      # emitted 1 .. k+1 tokens
        self.phase_seconds: dict[str, float] = {}
        self.last_log = time.perf_counter()
        self.last_stats = 0.0                 # the first loop iteration reports: /metrics has the KV size at once

    # ---- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        reader = asyncio.create_task(self.read_front())
        in_flight: InFlight | None = None
        try:
            while not self.stopping:
                self.take_inbox()
                launched = self.schedule_and_launch()
                if in_flight:
                    await self.finish(in_flight)
                in_flight = launched
                if in_flight and not self.args.enable_overlap:
                    await self.finish(in_flight)
                    in_flight = None
                self.report()
                if in_flight is None and not self.scheduler.has_work:
                    await self.idle()
            if in_flight:
                await self.finish(in_flight)
        finally:
            reader.cancel()
            self.tracer.close()

    def schedule_and_launch(self) -> InFlight | None:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = InFlight(batch, self.runner.launch(batch)) if batch else None
        end = time.perf_counter()
        self.overlap.cpu(start, end)
        if batch:
            self.tracer.span("schedule", f"schedule {batch.step}", start, scheduled,
                             seqs=len(batch.seqs), tokens=batch.num_tokens)
            self.tracer.span("launch", f"launch {batch.step}", scheduled, end)
        return launched

    async def finish(self, in_flight: InFlight) -> None:
        result = await in_flight.launched
        start = time.perf_counter()
        launched = in_flight.launched
        self.overlap.device(launched.started, launched.finished)
        self.tracer.span("device", f"forward {in_flight.batch.step}", launched.started, launched.finished,
                         tokens=in_flight.batch.num_tokens)
        output = self.runner.output(result)
        if in_flight.batch.is_spec_decode:
            self.account_spec_step(in_flight, output)
        touched = self.scheduler.process(in_flight.batch, output)
        self.generated += sum(len(run) for run in output.tokens)
        for req in touched:
            self.send_delta(req)
        end = time.perf_counter()
        self.overlap.cpu(start, end)
        self.tracer.span("process", f"process {in_flight.batch.step}", start, end)

    def account_spec_step(self, in_flight: InFlight, output) -> None:
        if in_flight.batch.chain:             # plain steps under load are counted apart (spec_off_steps)
            for run in output.tokens:
                self.accept_hist[len(run) - 1] += 1
        t = in_flight.launched.started
        for phase, seconds in self.runner.spec.take_phase_times():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
            self.tracer.span("device", phase, t, t + seconds)
            t += seconds

    async def idle(self) -> None:
        self.wake.clear()
        if not self.inbox:
            try:
                await asyncio.wait_for(self.wake.wait(), STATS_INTERVAL)
            except asyncio.TimeoutError:
                pass
        await self.channel.writer.drain()

    # ---- the front -----------------------------------------------------------------

    async def read_front(self) -> None:
        try:
            while True:
                msg = await self.channel.recv()
                self.inbox.append(msg)       # NOTE: not `self.inbox.append(await ...)`: take_inbox swaps the list
                self.wake.set()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            log.warning("rank %d: front connection closed (%s); stopping", self.rank, type(exc).__name__)
            self.inbox.append(Shutdown())
            self.wake.set()

    def take_inbox(self) -> None:
        """Apply new requests and aborts before scheduling (aborts first within the batch of messages)."""
        messages, self.inbox = self.inbox, []
        for msg in messages:
            if isinstance(msg, AddRequest):
                log.debug("add %s (%d prompt tokens)", msg.rid, len(msg.input_ids))
                error = self.scheduler.add(msg.rid, msg.input_ids, msg.params)
                if error:
                    status = 503 if error == "overloaded" else 400
                    self.channel.send_nowait(RequestRejected(msg.rid, error, status))
            elif isinstance(msg, AbortRequest):
                req = self.scheduler.abort(msg.rid, "abort" if msg.reason == "abort" else "stop")
                if req:
                    self.send_delta(req)
            elif isinstance(msg, Shutdown):
                self.stopping = True

    def send_delta(self, req: Request) -> None:
        new = req.output_ids[req.sent:]
        if not req.finished and len(new) < self.args.stream_interval:
            return                            # --stream-interval: batch small deltas
        if req.params.logprobs is not None:
            logprobs = req.output_logprobs[req.sent:]
            top = req.output_top_logprobs[req.sent:]
        else:
            logprobs = top = None
        if req.finished:
            log.debug("finish %s: %s after %d tokens", req.rid, req.finish_reason, len(req.output_ids))
        self.channel.send_nowait(TokenDelta(
            rid=req.rid, token_ids=new, logprobs=logprobs, top_logprobs=top,
            finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
            spec_verify_ct=req.spec_verify_ct))
        req.sent = len(req.output_ids)

    def report(self) -> None:
        now = time.perf_counter()
        if now - self.last_stats < STATS_INTERVAL:
            return
        self.channel.send_nowait(self.stats())
        if now - self.last_log >= LOG_INTERVAL and self.generated:
            log.info("rank %d: %.1f tok/s, running %d, waiting %d, KV %d/%d, hidden CPU %.0f%%%s",
                     self.rank, self.generated / (now - self.last_log), len(self.scheduler.running),
                     len(self.scheduler.waiting), self.pool.used_slots, self.pool.total_slots,
                     100 * self.overlap.hidden_fraction,
                     self.spec_log_text())
            self.generated, self.last_log = 0, now
        self.last_stats = now

    def spec_log_text(self) -> str:
        if not self.runner.spec:
            return ""
        off = self.scheduler.spec_off_steps
        return f", accept length {self.accept_length():.2f}" + (f", speculation off for {off} steps (load)" if off else "")

    def accept_length(self) -> float:
        steps = sum(self.accept_hist)
        return sum((i + 1) * c for i, c in enumerate(self.accept_hist)) / steps if steps else 0.0

    def stats(self) -> RankStats:
        return RankStats(rank=self.rank, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                         kv_used=self.pool.used_slots, kv_total=self.pool.total_slots, steps=self.scheduler.step,
                         hidden_cpu_fraction=self.overlap.hidden_fraction, retractions=self.scheduler.retractions,
                         spec_accept_len=self.accept_length(), spec_accept_hist=list(self.accept_hist),
                         spec_phase_seconds=dict(self.phase_seconds), spec_steps=sum(self.accept_hist),
                         spec_off_steps=self.scheduler.spec_off_steps)
