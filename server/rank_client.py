"""The front's side of the rank processes: spawn them, talk to them over unix sockets, route
each request's deltas to its stream, and supervise them.

Supervision: when a rank process dies (an exception, SIGKILL, the OOM killer) its in-flight
requests fail at once, its gauges leave /metrics, and a new process is started that loads the
model again and rejoins. More than --max-rank-restarts deaths within RESTART_WINDOW_S make the
front give up (`gave_up` is set): the server then exits non-zero so that its own supervisor
(systemd, Kubernetes) takes over.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections import deque
from typing import AsyncIterator

from engine.args import ServerArgs
from engine.messages import (AbortRequest, AddRequest, FromRank, KvLayer, PrefillDone, PrefillReserved, RankReady,
                             RankStats, RequestFailed, RequestRejected, SamplingParams, Shutdown, TokenDelta)
from engine.rank_main import rank_main
from engine.wire import Channel
from server.engine_client import EngineClient, EngineDead, EngineFailed, EngineRejected

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0
RESTART_WINDOW_S = 600.0
WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 2.0


class RankLink:
    """One rank: its current process and connection (both replaced when it restarts)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.process: mp.process.BaseProcess | None = None
        self.channel: Channel | None = None
        self.ready: RankReady | None = None
        self.stats: RankStats | None = None
        self.alive = False
        self.connected: asyncio.Future | None = None     # resolved with (channel, RankReady) by the socket server
        self.load = 0
        self.tasks: list[asyncio.Task] = []


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class RankEngineClient(EngineClient):
    def __init__(self, args: ServerArgs):
        self.args = args
        self.links = [RankLink(rank) for rank in range(args.dp_size)]
        self.streams: dict[str, asyncio.Queue] = {}
        self.owner: dict[str, RankLink] = {}
        self.round_robin = itertools.count()
        self.aborted: set[str] = set()         # aborted by the front; the stream's end must not abort again
        self.socket_dir = tempfile.mkdtemp(prefix="tandem-")
        self.socket_path = os.path.join(self.socket_dir, "front.sock")
        self.server: asyncio.AbstractServer | None = None
        self.deaths: deque[float] = deque()    # monotonic times of rank deaths in the restart window
        self.restarts = 0
        self.gave_up = asyncio.Event()
        self.give_up_reason = ""
        self.draining = False                  # shutting down: new requests are refused
        self.closing = False
        self.supervisors: set[asyncio.Task] = set()

    # ---- start and stop ------------------------------------------------------------

    async def start(self) -> list[RankReady]:
        self.server = await asyncio.start_unix_server(self.on_connect, path=self.socket_path)
        await asyncio.gather(*[self.bring_up(link) for link in self.links])
        return [link.ready for link in self.links]

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A rank process connected: its first frame says which rank it is."""
        channel = Channel(reader, writer, FromRank)
        try:
            ready = await asyncio.wait_for(channel.recv(), START_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.warning("a rank connected but never said it was ready (%s)", type(exc).__name__)
            channel.close()
            return
        link = self.links[ready.rank] if isinstance(ready, RankReady) and ready.rank < len(self.links) else None
        if link is None or link.connected is None or link.connected.done():
            log.warning("unexpected connection on the rank socket: %r", ready)
            channel.close()
            return
        link.connected.set_result((channel, ready))

    async def bring_up(self, link: RankLink) -> None:
        """Start the rank's process and wait until its model is loaded and it is connected."""
        ctx = mp.get_context("spawn")
        link.connected = asyncio.get_running_loop().create_future()
        link.process = ctx.Process(target=rank_main, args=(self.args, link.rank, self.socket_path),
                                   name=f"tandem-rank{link.rank}", daemon=True)
        link.process.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not link.connected.done():
            if not link.process.is_alive():
                raise RuntimeError(f"rank {link.rank} exited during start-up ({describe_exit(link.process.exitcode)}); "
                                   f"see its log above")
            if time.monotonic() > deadline:
                link.process.kill()
                raise RuntimeError(f"rank {link.rank} did not start in {START_TIMEOUT:.0f} s")
            await asyncio.wait({link.connected}, timeout=WATCH_INTERVAL_S)
        link.channel, link.ready = link.connected.result()
        link.alive = True
        link.tasks = [asyncio.create_task(self.read_rank(link)), asyncio.create_task(self.watch_process(link))]

    async def close(self) -> None:
        """Ask every rank to stop (each finishes its step in flight and flushes its trace), then
        make sure its process is gone."""
        self.closing = True
        for task in list(self.supervisors):
            task.cancel()
        for link in self.links:
            if link.alive and link.channel:
                with contextlib.suppress(ConnectionError):
                    await link.channel.send(Shutdown())
        for link in self.links:
            await self.reap(link)
            for task in link.tasks:
                task.cancel()
        if self.server is not None:
            self.server.close()

    async def reap(self, link: RankLink) -> None:
        if link.process is None:
            return
        await asyncio.to_thread(link.process.join, 10)
        if link.process.is_alive():
            log.warning("rank %d did not stop in time; killing it", link.rank)
            link.process.kill()
            await asyncio.to_thread(link.process.join, 5)

    # ---- per request ---------------------------------------------------------------

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       mode: str = "unified") -> AsyncIterator[TokenDelta]:
        """A request's messages from its rank: TokenDeltas until the one that finishes it; with mode
        "prefill", KvLayers then PrefillDone; with mode "decode", PrefillReserved first."""
        link = self.pick_rank()
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        self.owner[rid] = link
        link.load += 1
        finished = False
        self.aborted.discard(rid)
        try:
            link.channel.send_nowait(AddRequest(rid, input_ids, params, mode))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = isinstance(item, PrefillDone) or getattr(item, "finish_reason", None) is not None
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(rid, None)
            self.owner.pop(rid, None)
            link.load -= 1
            if not finished and link.alive and rid not in self.aborted:
                link.channel.send_nowait(AbortRequest(rid, "abort"))
            self.aborted.discard(rid)

    def send(self, rid: str, msg: KvLayer | PrefillDone) -> None:
        """Forward a message to the rank that holds the request (arriving KV, on a decode node)."""
        link = self.owner.get(rid)
        if link and link.alive:
            link.channel.send_nowait(msg)

    async def abort(self, rid: str, reason: str = "abort") -> None:
        link = self.owner.get(rid)
        if link and link.alive and rid not in self.aborted:
            self.aborted.add(rid)
            link.channel.send_nowait(AbortRequest(rid, reason))

    def pick_rank(self) -> RankLink:
        if self.draining:
            raise EngineDead("the server is shutting down")
        alive = [link for link in self.links if link.alive]
        if not alive:
            raise EngineDead("no rank is running (restarting)" if not self.gave_up.is_set() else "no rank is running")
        least = min(link.load for link in alive)
        candidates = [link for link in alive if link.load == least]
        return candidates[next(self.round_robin) % len(candidates)]

    def is_healthy(self) -> bool:
        return not self.draining and any(link.alive for link in self.links)

    def rank_stats(self) -> list[RankStats]:
        return [link.stats for link in self.links if link.alive and link.stats is not None]

    def ranks_up(self) -> int:
        return sum(link.alive for link in self.links)

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def fail_all(self, why: str) -> None:
        """End every request in flight with an error (shutdown); the ranks are told to abort them."""
        for rid, queue in list(self.streams.items()):
            queue.put_nowait(EngineDead(why))
            link = self.owner.get(rid)
            if link and link.alive and rid not in self.aborted:
                self.aborted.add(rid)
                link.channel.send_nowait(AbortRequest(rid, "abort"))

    # ---- per rank ------------------------------------------------------------------

    async def read_rank(self, link: RankLink) -> None:
        channel = link.channel
        try:
            while True:
                msg = await channel.recv()
                if isinstance(msg, RankStats):
                    link.stats = msg
                    continue
                queue = self.streams.get(msg.rid)
                if queue is None:
                    continue
                if isinstance(msg, (TokenDelta, KvLayer, PrefillDone, PrefillReserved)):
                    queue.put_nowait(msg)
                elif isinstance(msg, RequestRejected):
                    queue.put_nowait(EngineRejected(msg.message, msg.status))
                elif isinstance(msg, RequestFailed):
                    queue.put_nowait(EngineFailed(msg.message))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.rank_died(link, f"connection lost ({type(exc).__name__})")

    async def watch_process(self, link: RankLink) -> None:
        process = link.process
        while process.is_alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        await asyncio.to_thread(process.join, 1)
        self.rank_died(link, describe_exit(process.exitcode))

    def rank_died(self, link: RankLink, why: str) -> None:
        """Fail its requests, forget its gauges, and start a new process (once per death)."""
        if not link.alive:
            return
        link.alive, link.stats = False, None
        if self.closing:
            return
        link.channel.close()
        log.error("rank %d died (%s); failing its %d requests", link.rank, why, link.load)
        for rid, owner in list(self.owner.items()):
            if owner is link and rid in self.streams:
                self.streams[rid].put_nowait(EngineDead(f"rank {link.rank} died: {why}"))
        task = asyncio.create_task(self.restart(link))
        self.supervisors.add(task)
        task.add_done_callback(self.supervisors.discard)

    async def restart(self, link: RankLink) -> None:
        for task in link.tasks:
            task.cancel()
        await asyncio.to_thread(link.process.join, EXIT_GRACE_S)      # it may be ending itself
        if link.process.is_alive():
            link.process.kill()                  # its connection broke: the process is no use any more
            await asyncio.to_thread(link.process.join, EXIT_GRACE_S)
        log.error("rank %d process %d ended: %s", link.rank, link.process.pid, describe_exit(link.process.exitcode))
        while True:
            now = time.monotonic()
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
                self.deaths.popleft()
            if len(self.deaths) > self.args.max_rank_restarts:
                self.give_up(f"{len(self.deaths)} rank deaths within {RESTART_WINDOW_S / 60:.0f} minutes "
                             f"(--max-rank-restarts {self.args.max_rank_restarts})")
                return
            log.warning("restarting rank %d (restart %d in the window)", link.rank, len(self.deaths))
            try:
                await self.bring_up(link)
            except RuntimeError as exc:
                log.error("rank %d failed to restart: %s", link.rank, exc)
                continue
            self.restarts += 1
            log.info("rank %d is back: %s", link.rank, link.ready.description)
            return

    def give_up(self, reason: str) -> None:
        self.give_up_reason = reason
        log.critical("giving up: %s; the server exits so that its supervisor can take over", reason)
        self.gave_up.set()
