"""The front's side of the rank processes: spawn them, talk to them over unix
sockets, route each request's deltas to its stream, notice when a rank dies."""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
from typing import AsyncIterator

from engine.args import ServerArgs
from engine.messages import (AbortRequest, AddRequest, FromRank, RankReady, RankStats, RequestRejected,
                             SamplingParams, Shutdown, TokenDelta)
from engine.rank_main import rank_main
from engine.wire import Channel
from server.engine_client import EngineClient, EngineDead, EngineRejected

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0


class RankLink:
    def __init__(self, rank: int, process: mp.process.BaseProcess):
        self.rank = rank
        self.process = process
        self.channel: Channel | None = None
        self.ready: RankReady | None = None
        self.stats: RankStats | None = None
        self.alive = True
        self.load = 0


class RankEngineClient(EngineClient):
    def __init__(self, args: ServerArgs):
        self.args = args
        self.links: list[RankLink] = []
        self.streams: dict[str, asyncio.Queue] = {}
        self.owner: dict[str, RankLink] = {}
        self.tasks: list[asyncio.Task] = []
        self.round_robin = itertools.count()
        self.aborted: set[str] = set()         # aborted by the front; the stream's end must not abort again
        self.socket_dir = tempfile.mkdtemp(prefix="tandem-")

    # ---- start and stop ------------------------------------------------------------

    async def start(self) -> list[RankReady]:
        socket_path = os.path.join(self.socket_dir, "front.sock")
        connected: asyncio.Queue = asyncio.Queue()

        async def on_connect(reader, writer):
            await connected.put(Channel(reader, writer, FromRank))

        server = await asyncio.start_unix_server(on_connect, path=socket_path)
        ctx = mp.get_context("spawn")
        for rank in range(self.args.dp_size):
            proc = ctx.Process(target=rank_main, args=(self.args, rank, socket_path), name=f"tandem-rank{rank}",
                               daemon=True)
            proc.start()
            self.links.append(RankLink(rank, proc))
        try:
            for _ in self.links:
                channel = await self.wait_connected(connected)
                ready = await asyncio.wait_for(channel.recv(), START_TIMEOUT)
                link = self.links[ready.rank]
                link.channel, link.ready = channel, ready
        finally:
            server.close()
        for link in self.links:
            self.tasks.append(asyncio.create_task(self.read_rank(link)))
            self.tasks.append(asyncio.create_task(self.watch_process(link)))
        return [link.ready for link in self.links]

    async def wait_connected(self, connected: asyncio.Queue) -> Channel:
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT
        while True:
            dead = [link for link in self.links if not link.process.is_alive()]
            if dead:
                raise RuntimeError(f"rank {dead[0].rank} exited during start-up (code {dead[0].process.exitcode}); "
                                   f"see its log above")
            try:
                return await asyncio.wait_for(connected.get(), 0.5)
            except asyncio.TimeoutError:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError("ranks did not start in time")

    async def close(self) -> None:
        for link in self.links:
            if link.alive and link.channel:
                try:
                    await link.channel.send(Shutdown())
                except ConnectionError:
                    pass
        for task in self.tasks:
            task.cancel()
        for link in self.links:
            await asyncio.to_thread(link.process.join, 10)
            if link.process.is_alive():
                link.process.kill()

    # ---- per request ---------------------------------------------------------------

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        link = self.pick_rank()
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        self.owner[rid] = link
        link.load += 1
        finished = False
        self.aborted.discard(rid)
        try:
            link.channel.send_nowait(AddRequest(rid, input_ids, params))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
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

    async def abort(self, rid: str, reason: str = "abort") -> None:
        link = self.owner.get(rid)
        if link and link.alive and rid not in self.aborted:
            self.aborted.add(rid)
            link.channel.send_nowait(AbortRequest(rid, reason))

    def pick_rank(self) -> RankLink:
        alive = [link for link in self.links if link.alive]
        if not alive:
            raise EngineDead("no rank is running")
        least = min(link.load for link in alive)
        candidates = [link for link in alive if link.load == least]
        return candidates[next(self.round_robin) % len(candidates)]

    def is_healthy(self) -> bool:
        return bool(self.links) and all(link.alive for link in self.links)

    def rank_stats(self) -> list[RankStats]:
        return [link.stats for link in self.links if link.stats is not None]

    # ---- per rank ------------------------------------------------------------------

    async def read_rank(self, link: RankLink) -> None:
        try:
            while True:
                msg = await link.channel.recv()
                if isinstance(msg, TokenDelta):
                    queue = self.streams.get(msg.rid)
                    if queue:
                        queue.put_nowait(msg)
                elif isinstance(msg, RequestRejected):
                    queue = self.streams.get(msg.rid)
                    if queue:
                        queue.put_nowait(EngineRejected(msg.message, msg.status))
                elif isinstance(msg, RankStats):
                    link.stats = msg
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.mark_dead(link, f"connection lost ({type(exc).__name__})")

    async def watch_process(self, link: RankLink) -> None:
        while link.process.is_alive():
            await asyncio.sleep(0.5)
        self.mark_dead(link, f"process exited with code {link.process.exitcode}")

    def mark_dead(self, link: RankLink, why: str) -> None:
        if not link.alive:
            return
        link.alive = False
        log.error("rank %d is gone: %s; failing its requests", link.rank, why)
        for rid, owner in list(self.owner.items()):
            if owner is link and rid in self.streams:
                self.streams[rid].put_nowait(EngineDead(f"rank {link.rank} died: {why}"))
