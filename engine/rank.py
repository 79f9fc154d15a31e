"""One DP rank: a coroutine loop around the engine core, which overlaps CPU scheduling of
batch N+1 with device execution of batch N (engine/core.py).

    take new requests and aborts from the front
    news = await core.step()      # schedule + launch N+1, finish N
    send each request's news to the front

`--disable-overlap-schedule` runs the same steps without the lag.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from devices.base import Device
from engine.args import ServerArgs
from engine.core import EngineCore, Finished
from engine.decoding import speculation_stats
from engine.kv_pool import KVPool
from engine.dp import DpCounters, DpGroup
from engine.disagg import PrefillExporter, RemoteKv, prefill_params
from engine.graph_capture import capture_graphs
from engine.grammar import Grammar, GrammarCompiler
from engine.grammar_intake import Compiled, GrammarIntake
from engine.messages import (AbortRequest, AddRequest, CacheFlushed, FlushCache, KvLayer, PrefillDone, RankStats,
                             RequestFailed, RequestRejected, Shutdown, Stat, TokenDelta)
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.launch_budget import LaunchBudget
from engine.policy import DecodePolicy
from engine.scheduler import Scheduler, SchedulerConfig
from engine.gc_pause import PAUSES
from engine.stats import graph_stats, process_stats
from engine.trace import Tracer
from engine.framing import Connection

log = logging.getLogger(__name__)
STATS_INTERVAL = 0.5        # also the longest a rank of an idle DP-attention group waits (the front wakes it: Wake)
LOG_INTERVAL = 10.0


def scheduler_config(args: ServerArgs, runner: ModelRunner, future_slots: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
        max_prefill_tokens=args.max_prefill_tokens, chunked_prefill_size=args.chunked_prefill_size,
        context_length=runner.context_length, future_slots=future_slots)


def decode_policy(args: ServerArgs, runner: ModelRunner) -> DecodePolicy:
    """The CPU side of how the runner decodes: the policy its decoding makes (engine/decoding.py)."""
    steps, budget = args.scheduler_steps(runner.device.name), LaunchBudget(args.max_launch_ms / 1000)
    log.info("decode launches: %s", "one step each" if steps == 1 else
             f"up to {steps} steps each while no prompt waits" +
             (f", as many as fit in {args.max_launch_ms:g} ms" if args.max_launch_ms else ""))
    policy = runner.decoding.policy(steps, budget)
    if runner.spec_tokens:
        off = args.spec_off_batch_size
        fixed = f"; every decode plain from {off} decoding requests (--speculative-disable-by-batch-size)" \
            if off else ""
        log.info("speculation gate: %s%s", policy.gate.describe() if policy.gate else
                 f"off (--speculative-adaptive {args.speculative_adaptive})", fixed)
    return policy


def build_core(args: ServerArgs, device: Device, eos_ids: frozenset[int], tracer: Tracer | None = None,
               dp: DpGroup | None = None) -> EngineCore:
    """The model runner, KV pool, decode policy and scheduler of one rank, wired as the rank runs them."""
    future_slots = 2 * args.max_running_requests + 2        # two batches of outputs in flight
    runner = ModelRunner(args, device, future_slots, dp)
    capture_graphs(runner)
    device.order_after_setup()
    pool = KVPool(runner.num_slots, args.page_size, runner.num_rows, cache=not args.disable_radix_cache,
                  cache_lookahead=runner.decoding.draft_lookahead)
    scheduler = Scheduler(scheduler_config(args, runner, future_slots), pool, eos_ids, decode_policy(args, runner))
    return EngineCore(scheduler, runner, args.enable_overlap, tracer, dp)


class Rank:
    def __init__(self, args: ServerArgs, rank: int, device: Device, channel: Connection, eos_ids: frozenset[int],
                 dp: DpGroup | None = None):
        self.args, self.rank, self.device, self.channel = args, rank, device, channel
        self.tracer = Tracer(args.trace_file, rank)
        self.core = build_core(args, device, eos_ids, self.tracer, dp)
        self.dp = dp
        self.core.observers.append(self.account)
        self.runner, self.scheduler, self.pool = self.core.runner, self.core.scheduler, self.core.scheduler.pool
        self.exporter = PrefillExporter(self.core, channel)     # requests prefilled here for a decode node
        self.remote = RemoteKv(self.core, channel)              # requests prefilled on a prefill node
        self.inbox: list = []
        self.wake = asyncio.Event()
        self.stopping = False
        self.front_lost: Exception | None = None      # the link to the front broke before a Shutdown
        self.generated = 0
        self.spec_stats = speculation_stats(self.runner.spec_tokens)
        compiler = GrammarCompiler(args.tokenizer, self.runner.vocab_size, self.scheduler.eos_ids)
        self.intake = GrammarIntake(compiler, args.max_queued_requests, self.deliver)
        self.stat_tables = component_tables(self.core, self.spec_stats, dp) + [self.intake.stats]
        self.last_log = time.perf_counter()
        self.last_stats = 0.0                 # the first loop iteration reports: /metrics has the KV size at once

    # ---- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.read_front()), asyncio.create_task(self.exporter.run())]
        if self.channel.heartbeat_interval is not None:         # a rank of another host, over TCP
            tasks.append(asyncio.create_task(self.channel.keepalive()))
        try:
            while not self.done():
                self.take_inbox()
                self.remote.reserve()
                self.send_news(await self.core.step(self.stopping) + self.remote.take_failed())
                if self.core.broken:
                    await self.channel.writer.drain()       # the failed requests hear of it first
                    raise self.core.broken
                self.report()
                if self.has_nothing_to_do():
                    await self.idle(STATS_INTERVAL)
            self.send_news(await self.core.close())
            await self.channel.writer.drain()
        except ConnectionError as exc:          # a send to a front that is gone: nobody is left to serve
            log.warning("rank %d: cannot reach the front (%s: %s); stopping", self.rank, type(exc).__name__, exc)
            self.front_lost = self.front_lost or exc
        finally:
            for task in tasks:
                task.cancel()
            self.intake.close()
            self.tracer.close()

    def account(self, done: Finished) -> None:
        """Tokens, accept lengths and speculative phase times of each processed step."""
        self.generated += sum(len(run) for run in done.output.tokens)
        if not done.batch.is_spec_decode:
            return
        self.spec_stats.count(done.batch, done.output)
        t = done.launched.started
        for phase, seconds in self.runner.phase_times(done.result):
            self.spec_stats.add_phase(phase, seconds)
            self.tracer.span("device", phase, t, t + seconds)
            t += seconds

    def done(self) -> bool:
        """Stop: asked to (with DP attention, once the whole group agreed to)."""
        return self.core.plan.stop if self.dp else self.stopping

    def has_nothing_to_do(self) -> bool:
        """Wait for news before the next step. With DP attention only when no rank of the group had
        a batch: the others would wait for this rank's next exchange."""
        if self.dp:
            return not self.core.plan.run and self.core.in_flight is None
        return not self.core.busy or self.core.stalled

    async def idle(self, timeout: float) -> None:
        self.wake.clear()
        if not self.inbox and not self.core.busy:
            PAUSES.freeze_new_imports()        # engine/gc_pause.py: what a lazy import brought
        if not self.inbox:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        await self.channel.writer.drain()

    def stop(self) -> None:
        """Finish the step in flight and stop (the front tells the rank so with Shutdown)."""
        self.stopping = True
        self.wake.set()

    # ---- the front -----------------------------------------------------------------

    async def read_front(self) -> None:
        try:
            while True:
                msg = await self.channel.recv()
                self.inbox.append(msg)       # NOTE: not `self.inbox.append(await ...)`: take_inbox swaps the list
                self.wake.set()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            log.warning("rank %d: front connection closed (%s: %s); stopping", self.rank, type(exc).__name__, exc)
            if not self.stopping and not any(isinstance(msg, Shutdown) for msg in self.inbox):
                self.front_lost = exc           # not told to stop: the rank exits non-zero (rank_main.py)
            self.inbox.append(Shutdown())
            self.wake.set()

    def take_inbox(self) -> None:
        """Apply new requests, aborts and arriving KV before scheduling, in the order they came."""
        messages, self.inbox = self.inbox, []
        for msg in messages:
            if isinstance(msg, (AddRequest, Compiled)):
                self.add(msg) if isinstance(msg, AddRequest) else self.admit_compiled(msg)
            elif isinstance(msg, AbortRequest):
                self.abort(msg)
            elif isinstance(msg, KvLayer):
                self.send_news(self.remote.write(msg))
            elif isinstance(msg, PrefillDone):
                self.send_news(self.remote.activate(msg))
            elif isinstance(msg, FlushCache):
                self.channel.send_nowait(CacheFlushed(msg.nonce, self.scheduler.flush_cache()))
            elif isinstance(msg, Shutdown):
                self.stop()

    def abort(self, msg: AbortRequest) -> None:
        if not self.intake.abort(msg.rid):          # not compiling its grammar: in the scheduler, or gone
            req = self.scheduler.abort(msg.rid, "abort" if msg.reason == "abort" else "stop")
            self.send_news([req] if req else [])

    def add(self, msg: AddRequest) -> None:
        """A new request joins the scheduler; one with a grammar once the grammar is compiled."""
        log.debug("add %s (%d prompt tokens, %s)", msg.rid, len(msg.input_ids), msg.mode)
        if msg.params.grammar is None:
            return self.admit(msg, None)
        try:
            compiled = self.intake.start(msg)
        except OverflowError:
            return self.reject(msg.rid, "overloaded", 503)
        if compiled is not None:
            self.admit_compiled(compiled)

    def admit_compiled(self, compiled: Compiled) -> None:
        if compiled.grammar is None:
            self.reject(compiled.msg.rid, compiled.error, 400)
        else:
            self.admit(compiled.msg, compiled.grammar)

    def admit(self, msg: AddRequest, grammar: Grammar | None) -> None:
        params = prefill_params(msg.params) if msg.mode == "prefill" else msg.params
        error = self.scheduler.add(msg.rid, msg.input_ids, params, remote=msg.mode == "decode", grammar=grammar)
        if error:
            self.reject(msg.rid, error, 503 if error == "overloaded" else 400)
        elif msg.mode == "prefill":
            self.exporter.add(msg.rid)

    def reject(self, rid: str, error: str, status: int) -> None:
        self.channel.send_nowait(RequestRejected(rid, error, status))

    def deliver(self, compiled: Compiled) -> None:
        """A grammar compiled (on the loop): its request joins at the next look at the inbox."""
        self.inbox.append(compiled)
        self.wake.set()

    def send_news(self, requests: list[Request]) -> None:
        for req in requests:
            if self.exporter.finished(req):
                continue                          # its PrefillDone follows its KV
            if req.finish_reason == "error":
                self.channel.send_nowait(RequestFailed(req.rid, req.error))
            else:
                self.send_delta(req)

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
            spec_verify_ct=self.scheduler.policy.verify_steps(req), cached_tokens=req.cached_tokens))
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
                     100 * self.core.meter.hidden_fraction,
                     self.spec_stats.log_text(self.scheduler.policy))
            self.generated, self.last_log = 0, now
        self.last_stats = now

    def stats(self) -> RankStats:
        return RankStats(self.rank, [stat for table in self.stat_tables for stat in table()])


def component_tables(core: EngineCore, spec, dp: DpGroup | None) -> list[Callable[[], list[Stat]]]:
    """Each component's table of its metrics (engine/stats.py), in the order the rank reports them: a new
    component with counters adds its table here, and /metrics serves it as it is. `spec`: speculation's
    statistics (engine/decoding.py: speculation_stats)."""
    scheduler, runner = core.scheduler, core.runner
    dp_counters = dp.counters if dp else DpCounters()
    idle_replays = (lambda: runner.graphs.idle_replays) if runner.graphs else (lambda: 0)
    return [scheduler.stats, scheduler.pool.stats, core.meter.stats, core.stats, lambda: spec.stats(scheduler.policy),
            dp_counters.stats, lambda: graph_stats(runner.graph_runners(), idle_replays()), process_stats]
