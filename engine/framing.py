"""The framing of every Tandem socket: front <-> rank (a unix socket, or TCP for the ranks of other
hosts) and prefill node <-> decode node (TCP).

A frame is a header, the protocol version (2 bytes) and the body's length (4 bytes), big-endian, then
the body: one msgpack-encoded tagged message. The header is checked before the body is read: a frame
of another protocol version, or one over the size limit, is refused unread. Whatever the peer sends
that this side cannot accept closes the connection with a logged reason, and the peer is told why
(a Refused frame) when nothing else is queued for it; nothing else is harmed. Every error of a
connection is a ConnectionError subclass, so a read loop catches one type:

| error         | what happened                                                  |
|---------------|----------------------------------------------------------------|
| ProtocolError | the peer sent something this side cannot accept (a wrong version, an oversize or undecodable frame) |
| PeerClosed    | the peer closed (EOF), between frames or in the middle of one  |
| PeerSilent    | nothing at all arrived for the silence timeout (links with heartbeats) |
| Refusal       | one side refused the other (reason: what was wrong)            |

(A reset from the peer's kernel arrives as the OS's own ConnectionResetError.) Long-lived links
between nodes run heartbeats (`keepalive`); a Ping is answered inside `recv`. The handshake that
opens a link (engine/handshake.py) speaks the control messages defined here.
"""
from __future__ import annotations

import asyncio
import logging
import struct
import typing
from typing import Any

import msgspec

PROTOCOL_VERSION = 2
HEADER = struct.Struct("!HI")             # protocol version, body length
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
SILENT_AFTER_INTERVALS = 3
READ_CHUNK_BYTES = 4 * 1024 * 1024


# ---- control messages: every link's own, whatever it carries -----------------------

class Hello(msgspec.Struct, tag=True):
    role: str                       # "prefill" / "decode", "rank" / "front" (a str: a wrong one is refused by name)
    fingerprint: str                # what both sides must serve alike ("" where nothing is compared)
    nonce: bytes = b""              # fresh random bytes with a secret; empty: this side has none


class Proof(msgspec.Struct, tag=True):
    mac: bytes                      # HMAC-SHA256 of the secret over both nonces (engine/handshake.py)


class Welcome(msgspec.Struct, tag=True):
    pass


class Refused(msgspec.Struct, tag=True):
    reason: str


class Ping(msgspec.Struct, tag=True):
    pass


class Pong(msgspec.Struct, tag=True):
    pass


CONTROL = (Hello, Proof, Welcome, Refused, Ping, Pong)


# ---- errors ----------------------------------------------------------------------

class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame of the expected union."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF)."""


class PeerSilent(ConnectionError):
    """Nothing arrived from the peer for the silence timeout: it is gone or stuck."""


class Refusal(ConnectionError):
    """One side refused the other: this side refused the peer (by_peer False) or the peer refused it."""

    def __init__(self, reason: str, by_peer: bool = False):
        super().__init__(f"refused by the peer: {reason}" if by_peer else f"refused: {reason}")
        self.reason, self.by_peer = reason, by_peer


def decoder_of(incoming: Any) -> msgspec.msgpack.Decoder:
    """A decoder of the messages of `incoming` (a Struct or a union of them) and the control messages."""
    members = typing.get_args(incoming) or (incoming,)
    return msgspec.msgpack.Decoder(typing.Union[tuple(dict.fromkeys(members + CONTROL))])


def encode_frame(msg: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """One whole frame (header and body) of a message."""
    body = msgspec.msgpack.encode(msg)
    return HEADER.pack(version, len(body)) + body


# ---- a connection ------------------------------------------------------------------

class Connection:
    """Typed frames of one union in, any message out, over one stream pair.

    kind names the link in the log ("pd", "rank"): a connection logs to the logger tandem.<kind>.
    heartbeat_interval: seconds between Pings of `keepalive`; recv then gives up on a peer silent
    for three of them. None: a link without heartbeats, whose recv waits for as long as it takes.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: Any, *,
                 kind: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 heartbeat_interval: float | None = None):
        self.reader, self.writer = reader, writer
        self.decoder = decoder_of(incoming)
        self.encoder = msgspec.msgpack.Encoder()
        self.kind, self.log = kind, logging.getLogger(f"tandem.{kind}")
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat_interval = heartbeat_interval
        self.peer = peer_name(writer)
        self.close_reason: str | None = None
        self.last_sent = asyncio.get_running_loop().time()

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def send_nowait(self, msg: Any) -> None:
        """Queue a frame without waiting for the peer to take it (small messages, or a caller that drains)."""
        if self.closed:
            raise PeerClosed(f"{self.kind} connection to {self.peer} is closed: {self.close_reason}")
        body = self.encoder.encode(msg)
        if len(body) > self.max_frame_bytes:
            # refused here, so that one oversize message fails alone instead of the whole connection
            raise ValueError(f"{type(msg).__name__} of {len(body)} bytes exceeds the frame limit of "
                             f"{self.max_frame_bytes}")
        self.writer.write(HEADER.pack(PROTOCOL_VERSION, len(body)) + body)
        self.last_sent = asyncio.get_running_loop().time()

    async def send(self, msg: Any) -> None:
        """Send a frame; waits while the peer's socket is full (that is the backpressure)."""
        self.send_nowait(msg)
        await self.writer.drain()

    async def recv(self, timeout: float | None = None) -> Any:
        """The next message other than Ping / Pong (Ping is answered here); the peer's Refused raises Refusal.

        timeout: seconds without any byte from the peer before PeerSilent (default: three heartbeats,
        or none on a link without them). Any error closes the connection before it is raised.
        """
        if timeout is None and self.heartbeat_interval is not None:
            timeout = SILENT_AFTER_INTERVALS * self.heartbeat_interval
        if self.closed:
            raise PeerClosed(f"{self.kind} connection to {self.peer} is closed: {self.close_reason}")
        try:
            return await self._next_message(timeout)
        except ProtocolError as exc:
            self.refuse(str(exc))
            raise
        except ConnectionError as exc:
            # abort: nothing more is owed to this peer, and a send stuck on a full socket must end too
            self.close(str(exc), abort=True)
            raise

    async def _next_message(self, timeout: float | None) -> Any:
        while True:
            msg = await self._read_message(timeout)
            if isinstance(msg, Ping):
                # no drain: a peer that pings but does not read must not stall this read loop
                self.send_nowait(Pong())
            elif isinstance(msg, Refused):
                raise Refusal(msg.reason, by_peer=True)
            elif not isinstance(msg, Pong):
                return msg

    async def _read_message(self, timeout: float | None) -> Any:
        version, size = HEADER.unpack(await self._read_exactly(HEADER.size, timeout, mid_frame=False))
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol versions differ: {self.peer} sent a frame of version {version}, this "
                                f"side speaks {PROTOCOL_VERSION} (an older or newer Tandem, or not Tandem at all)")
        if size > self.max_frame_bytes:
            raise ProtocolError(f"frame of {size} bytes from {self.peer} exceeds the limit of "
                                f"{self.max_frame_bytes}")
        body = await self._read_exactly(size, timeout, mid_frame=True)
        try:
            return self.decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable frame from {self.peer}: {exc}") from exc

    async def _read_exactly(self, size: int, timeout: float | None, mid_frame: bool) -> bytes:
        """size bytes; PeerSilent when no byte arrives for timeout s (a large frame may take longer)."""
        if timeout is None:             # a link without heartbeats: one read, as fast as the stream gives it
            try:
                return await self.reader.readexactly(size)
            except asyncio.IncompleteReadError as exc:
                where = "in the middle of a frame" if exc.partial or mid_frame else "between frames"
                raise PeerClosed(f"{self.peer} closed the connection {where}") from None
        got = bytearray()
        while len(got) < size:
            try:
                chunk = await asyncio.wait_for(self.reader.read(min(size - len(got), READ_CHUNK_BYTES)), timeout)
            except asyncio.TimeoutError:
                raise PeerSilent(f"nothing from {self.peer} for {timeout:g} s") from None
            if not chunk:
                where = "in the middle of a frame" if got or mid_frame else "between frames"
                raise PeerClosed(f"{self.peer} closed the connection {where}")
            got += chunk
        return bytes(got)

    async def keepalive(self, interval: float | None = None) -> None:
        """Run as a task: send Ping whenever nothing was sent for interval s; ends when the connection does."""
        interval = self.heartbeat_interval if interval is None else interval
        loop = asyncio.get_running_loop()
        while not self.closed:
            idle = loop.time() - self.last_sent
            if idle < interval:
                await asyncio.sleep(interval - idle)
                continue
            try:
                await self.send(Ping())
            except ConnectionError as exc:
                self.close(f"heartbeat failed: {exc}")

    def refuse(self, reason: str) -> None:
        """Close with a logged reason, telling the peer why when nothing else is queued for it (a peer
        that does not read must not keep the socket open)."""
        if self.closed:
            return
        self.log.warning("%s connection to %s refused: %s", self.kind, self.peer, reason)
        if self.writer.transport.get_write_buffer_size() == 0:
            self.send_nowait(Refused(reason))
            self.close(f"refused: {reason}")
        else:
            self.close(f"refused: {reason}", abort=True)

    def close(self, reason: str, *, abort: bool = False) -> None:
        """Close once, logging why (the first reason is kept).

        abort: drop what is still queued for the peer and end at once (waiting sends raise);
        otherwise queued frames (a Refused) are delivered first.
        """
        if self.closed:
            return
        self.close_reason = reason
        self.log.info("%s connection to %s closed: %s", self.kind, self.peer, reason)
        if abort:
            self.writer.transport.abort()
        else:
            self.writer.close()

    async def wait_closed(self) -> None:
        """After close: until the socket is released."""
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass                # the peer reset it: it is closed all the same


def peer_name(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    if isinstance(addr, tuple):
        return f"{addr[0]}:{addr[1]}"
    return str(addr) if addr else "a local process"
