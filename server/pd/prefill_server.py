"""The prefill node's bootstrap port: decode nodes connect, ask for prefills and get KV back.

Per connection: a handshake (protocol version, model fingerprint, the shared secret when set),
heartbeats, then rooms. A room runs its prompt on a prefill rank (chunked and batched with the
others) and streams each chunk's KV back as soon as the rank exports it, then PrefillDone. Each
connection is written only by its own rooms and each frame waits for its socket to drain, so a slow
decode node slows its own transfers and never the prefill of others (the rank frees its slots as
soon as a chunk is copied out; what a slow peer has not read yet waits in this process).

Anything wrong with a connection (garbage, an oversize frame, a wrong version, model or secret, a
silent peer) closes that connection with a logged reason; its rooms are aborted in the ranks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.args import ServerArgs
from engine.framing import Connection
from engine.handshake import handshake
from engine.messages import KvLayer, PrefillDone
from server.engine_client import EngineDead, EngineFailed, EngineRejected
from server.pd.fingerprint import node_fingerprint
from server.pd.messages import AbortRoom, Busy, PrefillRequest, RoomDone, RoomFailed, ToPrefill
from server.pd.rooms import PdStats
from server.pd.transport import pd_connection, transport
from server.rank_client import RankEngineClient

log = logging.getLogger("tandem.pd")
HANDSHAKE_TIMEOUT_S = 10.0


class PrefillServer:
    def __init__(self, args: ServerArgs, engine: RankEngineClient, secret: bytes | None):
        self.args, self.engine = args, engine
        self.fingerprint, self.secret = "", secret
        self.transport = transport(args.disaggregation_transfer_backend)
        self.stats = PdStats("prefill")
        self.server: asyncio.AbstractServer | None = None
        self.peers: set[asyncio.Task] = set()

    async def start(self, readies: list) -> None:
        """Serve decode nodes, once the ranks (`readies`) are up: the fingerprint needs their dtype."""
        self.fingerprint = node_fingerprint(self.args, readies)
        self.server = await self.transport.serve(self.serve, self.args.host, self.args.disaggregation_bootstrap_port)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.peers):
            task.cancel()
        await asyncio.gather(*self.peers, return_exceptions=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.add(asyncio.current_task())
        conn = pd_connection(reader, writer, ToPrefill)
        try:
            await handshake(conn, "prefill", self.fingerprint, self.secret, HANDSHAKE_TIMEOUT_S)
        except ConnectionError as exc:
            log.warning("refused a decode node at %s: %s", conn.peer, exc)
            conn.close(str(exc))
            self.peers.discard(asyncio.current_task())
            return
        log.info("decode node %s connected", conn.peer)
        try:
            await DecodePeer(self, conn).run()
        finally:
            self.peers.discard(asyncio.current_task())


class DecodePeer:
    """One decode node's connection and its rooms."""

    def __init__(self, server: PrefillServer, conn: Connection):
        self.server, self.conn = server, conn
        self.rooms: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        keepalive = asyncio.create_task(self.conn.keepalive())
        try:
            while True:
                self.handle(await self.conn.recv())
        except ConnectionError as exc:
            log.warning("decode node %s lost (%s): aborting its %d rooms", self.conn.peer, exc, len(self.rooms))
        finally:
            keepalive.cancel()
            for task in list(self.rooms.values()):
                task.cancel()                  # closing each room's rank stream aborts its request there
            await asyncio.gather(*self.rooms.values(), return_exceptions=True)
            self.conn.close("done")

    def handle(self, msg) -> None:
        if isinstance(msg, PrefillRequest):
            if msg.rid in self.rooms:
                self.conn.send_nowait(RoomFailed(msg.rid, f"room {msg.rid!r} is already open"))
                return
            task = asyncio.create_task(self.room(msg))
            self.rooms[msg.rid] = task
            task.add_done_callback(lambda _, room=msg.rid: self.rooms.pop(room, None))
        elif isinstance(msg, AbortRoom):
            task = self.rooms.get(msg.rid)
            if task is not None:
                log.info("room %s aborted by the decode node: %s", msg.rid, msg.reason)
                task.cancel()
        elif isinstance(msg, RoomDone):
            pass                               # the rank kept nothing past the copy; the room is over here

    async def room(self, msg: PrefillRequest) -> None:
        stats = self.server.stats
        entry = stats.open(msg.rid)
        stats.advance(entry, "waiting")
        try:
            async with asyncio.timeout(self.server.args.disaggregation_timeout):
                await self.stream(msg, entry)
            stats.close(entry, "done")
        except asyncio.CancelledError:
            stats.close(entry, "failed", "aborted by the decode node")
            raise
        except (EngineRejected, EngineFailed, EngineDead, TimeoutError) as exc:
            reason = f"timed out after {self.server.args.disaggregation_timeout:g} s" \
                if isinstance(exc, TimeoutError) else str(exc)
            stats.close(entry, "failed", reason)
            busy = isinstance(exc, (EngineRejected, EngineDead)) and getattr(exc, "status", 503) == 503
            with contextlib.suppress(ConnectionError):
                self.conn.send_nowait((Busy if busy else RoomFailed)(msg.rid, reason))
        except ConnectionError as exc:
            stats.close(entry, "failed", f"connection lost: {exc}")

    async def stream(self, msg: PrefillRequest, entry) -> None:
        stats = self.server.stats
        async for item in self.server.engine.generate(msg.rid, msg.input_ids, msg.params, mode="prefill"):
            if isinstance(item, KvLayer):
                stats.moved(entry, len(item.data.data))
            elif not isinstance(item, PrefillDone):
                continue
            await self.conn.send(item)          # the rank's own message: its rid is the room
