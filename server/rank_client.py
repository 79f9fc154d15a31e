"""The front's side of the rank processes: spawn them, talk to them over unix sockets, route
each request's deltas to its stream, and supervise them.

Supervision: when a rank process dies (an exception, SIGKILL, the OOM killer), or the link of a rank
of another host breaks or goes silent (heartbeats: engine/rank_entry.py), its in-flight requests fail
at once, its gauges leave /metrics, and a new process is started that loads the model again and
rejoins (a rank of another host: its host starts it). More than --max-rank-restarts deaths within
RESTART_WINDOW_S make the front give up (`gave_up` is set): the server then exits non-zero so that
its own supervisor (systemd, Kubernetes) takes over.

Every rank's handshake compares its fingerprint with the front's (engine/fingerprint.py: the model
and the flags of what it computes), and its RankReady what it resolved with the other ranks'; a rank
that differs is refused with the reason logged on both sides, and never counts as up.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from collections import deque
from typing import AsyncIterator

from engine.args import ServerArgs
from engine.fingerprint import rank_fingerprint
from engine.framing import Connection
from engine.handshake import handshake, load_secret
from engine.messages import (AbortRequest, AddRequest, CacheFlushed, FlushCache, FromRank, KvLayer, PrefillDone,
                             PrefillReserved, RankReady, RankStats, RequestFailed, RequestRejected, SamplingParams,
                             Shutdown, TokenDelta, Wake)
from engine.rank_entry import EXIT_MEANINGS, RANK_HEARTBEAT_INTERVAL_S, rank_process
from server import prefix_router
from server.engine_client import EngineClient, EngineDead, EngineFailed, EngineRejected

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0
HANDSHAKE_TIMEOUT_S = 10.0
RESTART_WINDOW_S = 600.0
WATCH_INTERVAL_S = 0.2
FLUSH_TIMEOUT_S = 30.0
EXIT_GRACE_S = 2.0


class RankLink:
    """One rank: its current process and connection (both replaced when it restarts)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.process: mp.process.BaseProcess | None = None
        self.channel: Connection | None = None
        self.ready: RankReady | None = None
        self.stats: RankStats | None = None
        self.alive = False
        self.connected: asyncio.Future | None = None     # resolved with (channel, RankReady) by the socket server
        self.load = 0                     # requests in flight
        self.tokens = 0                   # their prompt and output budgets, in tokens
        self.prefixes = prefix_router.RankPrefixes()    # what its prefix cache likely holds (cache_aware)
        self.tasks: list[asyncio.Task] = []


def remote_rank_address(args: ServerArgs) -> tuple[str, int]:
    """Where node 0's front takes the ranks of the other hosts: the rendezvous port + 1."""
    host, _, port = args.dist_init_addr.rpartition(":")
    return host, int(port) + 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}" + (f" ({EXIT_MEANINGS[code]})" if code in EXIT_MEANINGS else "")


def resolved_mismatch(ready: RankReady, others: list[RankReady]) -> str | None:
    """What a rank resolved otherwise than the ranks already in (--dtype auto and the draft's auto
    quantization resolve on each host, by its CPU): None when it matches them all."""
    def resolved(r: RankReady) -> dict:
        return {"dtype": r.dtype, "KV dtype": r.kv_dtype or r.dtype, "draft quantization": r.draft_weights or "none"}
    mine = resolved(ready)
    for other in others:
        theirs = resolved(other)
        differing = [f"{name}: rank {other.rank} {theirs[name]}, rank {ready.rank} {mine[name]}"
                     for name in mine if mine[name] != theirs[name]]
        if differing:
            return "the ranks resolved their flags otherwise (pin --dtype and --speculative-draft-quantization " \
                   "on every host): " + "; ".join(differing)
    return None


class RankEngineClient(EngineClient):
    def __init__(self, args: ServerArgs):
        self.args = args
        self.links = [RankLink(rank) for rank in range(args.dp_size)]
        self.rank_args = self.with_group_address(args)          # what the rank processes are started with
        self.rank_secret = load_secret(args.rank_secret, "--rank-secret")
        self.fingerprint = rank_fingerprint(args)       # what every rank must serve alike (engine/fingerprint.py)
        self.streams: dict[str, asyncio.Queue] = {}
        self.owner: dict[str, RankLink] = {}
        self.round_robin = itertools.count()
        self.flush_nonces = itertools.count(1)
        self.flushes: dict[tuple[int, int], asyncio.Future] = {}     # (rank, nonce) -> its answer
        self.aborted: set[str] = set()         # aborted by the front; the stream's end must not abort again
        self.socket_dir = tempfile.mkdtemp(prefix="tandem-")
        self.socket_path = os.path.join(self.socket_dir, "front.sock")
        self.server: asyncio.AbstractServer | None = None
        self.remote_server: asyncio.AbstractServer | None = None
        self.deaths: deque[float] = deque()    # monotonic times of rank deaths in the restart window
        self.restarts = 0
        self.gave_up = asyncio.Event()
        self.give_up_reason = ""
        self.draining = False                  # shutting down: new requests are refused
        self.closing = False
        self.supervisors: set[asyncio.Task] = set()

    # ---- start and stop ------------------------------------------------------------

    async def start(self) -> list[RankReady]:
        await self.listen()
        await asyncio.gather(*[self.bring_up(link) for link in self.links])
        return [link.ready for link in self.links]

    async def listen(self) -> None:
        """Open the rank socket (and with --nnodes > 1 the rank port for the other hosts' ranks)."""
        log.info("ranks must serve: %s", self.fingerprint)
        self.server = await asyncio.start_unix_server(self.on_connect, path=self.socket_path)
        if self.args.nnodes > 1:                  # ranks on the other hosts connect over TCP, with heartbeats
            host, port = remote_rank_address(self.args)
            on_remote = functools.partial(self.on_connect, heartbeat=RANK_HEARTBEAT_INTERVAL_S)
            self.remote_server = await asyncio.start_server(on_remote, host, port)

    def is_local(self, link: RankLink) -> bool:
        """This host runs the rank's process (--nnodes > 1: the others run theirs)."""
        return link.rank < self.args.dp_size // self.args.nnodes

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         heartbeat: float | None = None) -> None:
        """A rank process connected: after the handshake, its first frame says which rank it is.
        heartbeat: the interval of a TCP link's heartbeats (they start once the rank is attached)."""
        channel = Connection(reader, writer, FromRank, kind="rank", heartbeat_interval=heartbeat)
        try:
            await handshake(channel, "front", self.fingerprint, self.rank_secret, HANDSHAKE_TIMEOUT_S)
            ready = await channel.recv(timeout=START_TIMEOUT)        # it loads its model meanwhile
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.warning("refused a rank connection from %s: %s", channel.peer, exc or type(exc).__name__)
            channel.close(f"refused: {exc or type(exc).__name__}", abort=True)
            return
        link = self.links[ready.rank] if isinstance(ready, RankReady) and ready.rank < len(self.links) else None
        if link is None or link.connected is None or link.connected.done():
            channel.refuse(f"unexpected first message on the rank socket: {type(ready).__name__}")
            return
        reason = resolved_mismatch(ready, self.readies_besides(link))
        if reason:
            channel.refuse(reason)
            # its host would resolve the same again: bring_up fails now rather than wait for another
            link.connected.set_exception(RuntimeError(f"rank {ready.rank} was refused: {reason}"))
            return
        link.connected.set_result((channel, ready))

    def readies_besides(self, link: RankLink) -> list[RankReady]:
        """The RankReady of every other rank connected now (attached or about to be)."""
        connected = [other.connected.result() for other in self.links if other is not link and
                     other.connected is not None and other.connected.done() and not other.connected.exception()]
        return [ready for channel, ready in connected if not channel.closed]

    async def bring_up(self, link: RankLink) -> None:
        """Start the rank's process and wait until its model is loaded and it is connected (a rank of
        another host: only wait for it, its host starts it)."""
        link.connected = asyncio.get_running_loop().create_future()
        if not self.is_local(link):
            try:
                await asyncio.wait_for(asyncio.shield(link.connected), START_TIMEOUT)
            except asyncio.TimeoutError:
                raise RuntimeError(f"rank {link.rank} (another host) did not connect in time") from None
            self.attach(link)
            return
        ctx = mp.get_context("spawn")
        link.process = ctx.Process(target=rank_process, args=(self.rank_args, link.rank, self.socket_path),
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
        self.attach(link)

    def attach(self, link: RankLink) -> None:
        link.channel, link.ready = link.connected.result()
        link.alive = True
        link.prefixes.clear()             # a new process: its cache starts empty
        link.tasks = [asyncio.create_task(self.read_rank(link))]
        if link.channel.heartbeat_interval is not None:
            link.tasks.append(asyncio.create_task(link.channel.keepalive()))
        if link.process is not None and self.is_local(link):
            link.tasks.append(asyncio.create_task(self.watch_process(link)))

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
        for server in (self.server, self.remote_server):
            if server is not None:
                server.close()

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
        link = self.pick_rank(input_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        self.owner[rid] = link
        tokens = len(input_ids) + params.max_new_tokens
        link.load += 1
        link.tokens += tokens
        finished = False
        self.aborted.discard(rid)
        try:
            link.channel.send_nowait(AddRequest(rid, input_ids, params, mode))
            self.wake_group(link)
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
            link.tokens -= tokens
            if not finished and link.alive and rid not in self.aborted:
                link.channel.send_nowait(AbortRequest(rid, "abort"))
            self.aborted.discard(rid)

    def send(self, rid: str, msg: KvLayer | PrefillDone) -> None:
        """Forward a message to the rank that holds the request (arriving KV, on a decode node)."""
        link = self.owner.get(rid)
        if link and link.alive:
            link.channel.send_nowait(msg)
            if isinstance(msg, PrefillDone):
                self.wake_group(link)

    def wake_group(self, busy: RankLink) -> None:
        """DP attention: the other ranks may be waiting for news; one of them has work, so all must step."""
        if self.args.enable_dp_attention:
            for link in self.links:
                if link is not busy and link.alive:
                    link.channel.send_nowait(Wake())

    async def abort(self, rid: str, reason: str = "abort") -> None:
        link = self.owner.get(rid)
        if link and link.alive and rid not in self.aborted:
            self.aborted.add(rid)
            link.channel.send_nowait(AbortRequest(rid, reason))

    def pick_rank(self, input_ids: list[int]) -> RankLink:
        """--load-balance-method: in turn, the fewest requests, the fewest tokens in flight, or where the
        prompt's prefix is likely cached (server/prefix_router.py)."""
        if self.draining:
            raise EngineDead("the server is shutting down")
        alive = [link for link in self.links if link.alive]
        if not alive:
            raise EngineDead("no rank is running (restarting)" if not self.gave_up.is_set() else "no rank is running")
        method = self.args.load_balance_method
        if method == "round_robin":
            return alive[next(self.round_robin) % len(alive)]
        if method == "cache_aware":
            loads, prefixes = [link.load for link in alive], [link.prefixes for link in alive]
            return alive[prefix_router.choose(input_ids, loads, prefixes)]
        load = (lambda link: link.tokens) if method == "total_tokens" else (lambda link: link.load)
        least = min(map(load, alive))
        candidates = [link for link in alive if load(link) == least]
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
                if isinstance(msg, (RankStats, CacheFlushed)):
                    self.rank_report(link, msg)
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
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self.rank_died(link, f"connection lost ({why})")

    def rank_report(self, link: RankLink, msg: RankStats | CacheFlushed) -> None:
        if isinstance(msg, RankStats):
            link.stats = msg
            return
        answer = self.flushes.get((link.rank, msg.nonce))
        if answer is not None and not answer.done():
            answer.set_result(msg.refused)

    async def flush_cache(self) -> str:
        """Empty every rank's prefix cache; why not, or "" when done. Refused while requests run
        (here, or on a rank: their pages are in use)."""
        if self.streams:
            return "requests are running"
        nonce, loop = next(self.flush_nonces), asyncio.get_running_loop()
        answers = {}
        for link in (link for link in self.links if link.alive):
            answers[link.rank, nonce] = self.flushes[link.rank, nonce] = loop.create_future()
            link.channel.send_nowait(FlushCache(nonce))
        try:
            refused = await asyncio.wait_for(asyncio.gather(*answers.values()), FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "a rank did not answer"
        finally:
            for key in answers:
                self.flushes.pop(key, None)
        return next((why for why in refused if why), "")

    async def watch_process(self, link: RankLink) -> None:
        process = link.process
        while process.is_alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        await asyncio.to_thread(process.join, 1)
        self.rank_died(link, describe_exit(process.exitcode))

    def rank_died(self, link: RankLink, why: str) -> None:
        """Fail its requests, forget its gauges, and start a new process (once per death). With DP
        attention the ranks are one group: the others cannot go on without it, so all restart."""
        if not link.alive or self.closing:
            link.alive = False
            return
        log.error("rank %d died (%s); failing its %d requests", link.rank, why, link.load)
        group = [other for other in self.links if other.alive] if self.args.enable_dp_attention else [link]
        for member in group:
            self.take_down(member, f"rank {link.rank} died: {why}")
        task = asyncio.create_task(self.restart(group))
        self.supervisors.add(task)
        task.add_done_callback(self.supervisors.discard)

    def take_down(self, link: RankLink, why: str) -> None:
        link.alive, link.stats = False, None
        link.channel.close(why, abort=True)
        for rid, owner in list(self.owner.items()):
            if owner is link and rid in self.streams:
                self.streams[rid].put_nowait(EngineDead(why))

    async def restart(self, links: list[RankLink]) -> None:
        await asyncio.gather(*[self.reap_dead(link) for link in links])
        while True:
            if not self.count_death():
                return
            self.rank_args = self.with_group_address(self.args)
            names = ", ".join(str(link.rank) for link in links)
            log.warning("restarting rank %s (restart %d in the window)", names, len(self.deaths))
            try:
                await asyncio.gather(*[self.bring_up(link) for link in links])
            except RuntimeError as exc:
                log.error("rank %s failed to restart: %s", names, exc)
                for link in links:
                    if link.alive:
                        self.take_down(link, str(exc))       # a group is whole or not at all
                await asyncio.gather(*[self.reap_dead(link) for link in links])
                continue
            self.restarts += 1
            log.info("rank %s back: %s", names, links[0].ready.description)
            return

    async def reap_dead(self, link: RankLink) -> None:
        """Make sure the process is gone, and log how it ended."""
        for task in link.tasks:
            task.cancel()
        if link.process is None:
            return
        await asyncio.to_thread(link.process.join, EXIT_GRACE_S)      # it may be ending itself
        if link.process.is_alive():
            link.process.kill()                  # its connection broke: the process is no use any more
            await asyncio.to_thread(link.process.join, EXIT_GRACE_S)
        log.error("rank %d process %d ended: %s", link.rank, link.process.pid, describe_exit(link.process.exitcode))

    def count_death(self) -> bool:
        """Record a death; False (and give up) when there were too many in the window."""
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > self.args.max_rank_restarts:
            self.give_up(f"{len(self.deaths)} rank deaths within {RESTART_WINDOW_S / 60:.0f} minutes "
                         f"(--max-rank-restarts {self.args.max_rank_restarts})")
            return False
        return True

    @staticmethod
    def with_group_address(args: ServerArgs) -> ServerArgs:
        """DP attention on one host: a fresh rendezvous port for each (re)start of the group."""
        if not args.enable_dp_attention or args.nnodes > 1:
            return args
        return args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")

    def give_up(self, reason: str) -> None:
        self.give_up_reason = reason
        log.critical("giving up: %s; the server exits so that its supervisor can take over", reason)
        self.gave_up.set()
