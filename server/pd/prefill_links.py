"""The decode node's connections to its prefill nodes (--prefill-addr, one or more).

Each link connects, shakes hands, keeps the connection alive with heartbeats and reconnects after
losing it. A prefill goes to the connected node with the fewest prompt tokens in flight; if that
node refuses it (Busy) or is lost before anything of the room arrived, it is retried on another
node; once KV has arrived, losing the node fails the room. Every room has a deadline
(--disaggregation-timeout): nothing waits forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from engine.args import ServerArgs
from engine.framing import Connection
from engine.handshake import handshake
from engine.messages import KvLayer, PrefillDone, SamplingParams
from server.pd.messages import AbortRoom, Busy, PrefillRequest, RoomDone, RoomFailed, ToDecode
from server.pd.rooms import PdStats
from server.pd.transport import TcpTransport, pd_connection, transport

log = logging.getLogger("tandem.pd")
CONNECT_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = 10.0
RECONNECT_S = (0.2, 5.0)            # first and longest wait between attempts


class PrefillFailed(Exception):
    """A room could not be prefilled (retryable: nothing of it arrived, another node may take it)."""

    def __init__(self, reason: str, retryable: bool = False):
        super().__init__(reason)
        self.retryable = retryable


class PrefillLink:
    """One prefill node: its connection (while up) and the rooms waiting on it."""

    def __init__(self, addr: str, fingerprint: str, secret: bytes | None, transport: TcpTransport | None = None):
        self.addr, self.fingerprint, self.secret = addr, fingerprint, secret
        self.transport = transport or TcpTransport()
        host, _, port = addr.rpartition(":")
        self.host, self.port = host, int(port)
        self.conn: Connection | None = None
        self.rooms: dict[str, asyncio.Queue] = {}
        self.tokens = 0                   # prompt tokens of its rooms in flight
        self.connected = asyncio.Event()

    @property
    def up(self) -> bool:
        return self.conn is not None and not self.conn.closed

    async def run(self) -> None:
        """Connect, serve, reconnect, for as long as the node runs."""
        wait = RECONNECT_S[0]
        while True:
            try:
                await self.connect()
                wait = RECONNECT_S[0]
                await self.read()
            except ConnectionError as exc:
                self.lost(f"prefill node {self.addr} lost: {exc}")
            except (OSError, asyncio.TimeoutError) as exc:
                self.lost(f"cannot connect to prefill node {self.addr}: {exc!r}")
            await asyncio.sleep(wait)
            wait = min(wait * 2, RECONNECT_S[1])

    async def connect(self) -> None:
        reader, writer = await asyncio.wait_for(self.transport.connect(self.host, self.port), CONNECT_TIMEOUT_S)
        conn = pd_connection(reader, writer, ToDecode)
        try:
            await handshake(conn, "decode", self.fingerprint, self.secret, HANDSHAKE_TIMEOUT_S)
        except ConnectionError:
            conn.close("handshake failed")
            raise
        self.conn = conn
        self.connected.set()
        log.info("connected to prefill node %s", self.addr)

    async def read(self) -> None:
        keepalive = asyncio.create_task(self.conn.keepalive())
        try:
            while True:
                msg = await self.conn.recv()
                queue = self.rooms.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(msg)
        finally:
            keepalive.cancel()

    def lost(self, why: str) -> None:
        """Fail every room waiting on this node (each decides whether it can retry elsewhere)."""
        if self.conn is not None:
            self.conn.close(why)
        self.conn = None
        self.connected.clear()
        log.warning("%s (%d rooms)", why, len(self.rooms))
        for queue in self.rooms.values():
            queue.put_nowait(PrefillFailed(why, retryable=True))

    def open_room(self, room: str, tokens: int) -> asyncio.Queue:
        self.rooms[room] = queue = asyncio.Queue()
        self.tokens += tokens
        return queue

    def close_room(self, room: str, tokens: int, done: bool) -> None:
        self.rooms.pop(room, None)
        self.tokens -= tokens
        if self.up:
            with contextlib.suppress(ConnectionError):
                self.conn.send_nowait(RoomDone(room) if done else AbortRoom(room, "abort"))


class PrefillLinks:
    """All of the decode node's prefill nodes."""

    def __init__(self, args: ServerArgs, secret: bytes | None):
        self.args = args
        moves = transport(args.disaggregation_transfer_backend)
        self.links = [PrefillLink(addr, "", secret, moves) for addr in args.prefill_addr]
        self.tasks: list[asyncio.Task] = []
        self.stats = PdStats("decode")

    def start(self, fingerprint: str) -> None:
        """Connect to every prefill node, as a node whose model has `fingerprint`."""
        for link in self.links:
            link.fingerprint = fingerprint
        self.tasks = [asyncio.create_task(link.run()) for link in self.links]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for link in self.links:
            if link.conn is not None:
                link.conn.close("shutting down")

    def up(self) -> int:
        return sum(link.up for link in self.links)

    async def wait_up(self, timeout: float) -> bool:
        """Until some node is connected (start-up)."""
        waits = [asyncio.ensure_future(link.connected.wait()) for link in self.links]
        done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return bool(done)

    def pick(self, tried: set[str]) -> PrefillLink | None:
        ready = [link for link in self.links if link.up and link.addr not in tried]
        return min(ready, key=lambda link: link.tokens) if ready else None

    async def prefill(self, room: str, input_ids: list[int],
                      params: SamplingParams) -> AsyncIterator[KvLayer | PrefillDone]:
        """The room's KV layers, then its PrefillDone; PrefillFailed when no node could do it in time."""
        entry = self.stats.open(room)
        tried: set[str] = set()
        try:
            async with asyncio.timeout(self.args.disaggregation_timeout):
                while True:
                    link = await self.next_link(tried)
                    try:
                        async for msg in self.attempt(link, room, input_ids, params, entry):
                            yield msg
                    except PrefillFailed as exc:
                        if not exc.retryable:
                            raise
                        log.warning("room %s: %s; trying another prefill node", room, exc)
                        continue
                    self.stats.close(entry, "done")
                    return
        except PrefillFailed as exc:
            self.stats.close(entry, "failed", str(exc))
            raise
        except TimeoutError:
            reason = f"prefill timed out after {self.args.disaggregation_timeout:g} s"
            self.stats.close(entry, "failed", reason)
            raise PrefillFailed(reason) from None
        finally:
            self.stats.close(entry, "failed", "aborted")       # no-op once done or failed

    async def next_link(self, tried: set[str]) -> PrefillLink:
        """The least loaded node not tried yet, waiting briefly for one to (re)connect."""
        while True:
            link = self.pick(tried)
            if link is not None:
                tried.add(link.addr)
                return link
            if len(tried) >= len(self.links):
                raise PrefillFailed("no prefill node could take the request")
            await asyncio.sleep(RECONNECT_S[0])

    async def attempt(self, link: PrefillLink, room: str, input_ids: list[int], params: SamplingParams,
                      entry) -> AsyncIterator[KvLayer | PrefillDone]:
        """One node's try; retries elsewhere (by returning without PrefillDone) only before any KV arrived."""
        queue, done = link.open_room(room, len(input_ids)), False
        try:
            try:
                await link.conn.send(PrefillRequest(room, input_ids, params))
            except (ConnectionError, AttributeError) as exc:      # lost since it was picked
                raise PrefillFailed(f"prefill node {link.addr} lost: {exc!r}", retryable=True) from None
            self.stats.advance(entry, "waiting")
            while not done:
                msg = await queue.get()
                if isinstance(msg, (PrefillFailed, Busy, RoomFailed)):
                    raise failure(msg, received=entry.bytes > 0)
                if isinstance(msg, KvLayer):
                    self.stats.moved(entry, len(msg.data.data))
                done = isinstance(msg, PrefillDone)
                yield msg
        finally:
            link.close_room(room, len(input_ids), done)


def failure(msg, received: bool) -> PrefillFailed:
    if isinstance(msg, PrefillFailed):
        return PrefillFailed(str(msg), retryable=msg.retryable and not received)
    retryable = isinstance(msg, Busy) and not received
    return PrefillFailed(f"the prefill node {'is busy' if retryable else 'failed'}: {msg.reason}", retryable)
