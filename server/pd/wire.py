"""Prefill/decode frames over TCP: typed messages, heartbeats, and the handshake.

A frame is a 4-byte big-endian length, then a msgpack-encoded tagged message (server/pd/messages.py).
Whatever the peer sends that is not a frame of the union this side expects (an oversize length,
bytes msgpack cannot decode, a message of the other direction) closes the connection with a logged
reason and raises ProtocolError; nothing else is harmed. Every error of a connection is a
ConnectionError subclass, so a node's read loop catches one type and fails that peer's rooms:

| error            | what happened                                              |
|------------------|------------------------------------------------------------|
| ProtocolError    | the peer sent something this side cannot accept            |
| PeerClosed       | the peer closed (EOF), between frames or in the middle of one |
| PeerSilent       | nothing at all arrived for the silence timeout             |
| HandshakeRefused | one side refused the other (reason: what differed)         |

(A reset from the peer's kernel arrives as the OS's own ConnectionResetError.)
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import struct
from typing import Any

import msgspec

from server.pd.messages import Hello, Ping, Pong, Proof, Refused, Welcome

log = logging.getLogger("tandem.pd")

PROTOCOL_VERSION = 1
HEADER = struct.Struct("!I")
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
DEFAULT_HEARTBEAT_INTERVAL = 5.0
SILENT_AFTER_INTERVALS = 3
READ_CHUNK_BYTES = 4 * 1024 * 1024
NONCE_BYTES = 32
PROOF_LABEL = "tandem-pd-handshake-v1"


class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame of the expected union."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF)."""


class PeerSilent(ConnectionError):
    """Nothing arrived from the peer for the silence timeout: it is gone or stuck."""


class HandshakeRefused(ConnectionError):
    """The handshake failed: this side refused the peer (by_peer False) or the peer refused it."""

    def __init__(self, reason: str, by_peer: bool = False):
        super().__init__(f"handshake refused by the peer: {reason}" if by_peer else f"handshake refused: {reason}")
        self.reason, self.by_peer = reason, by_peer


class PdConnection:
    """Typed frames of one union in, any message out, over one TCP stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming_union: Any,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, *,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL):
        self.reader, self.writer = reader, writer
        self.decoder = msgspec.msgpack.Decoder(incoming_union)
        self.encoder = msgspec.msgpack.Encoder()
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat_interval = heartbeat_interval
        self.peer = _peer_name(writer)
        self.close_reason: str | None = None
        self.last_sent = asyncio.get_running_loop().time()

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def send_nowait(self, msg: Any) -> None:
        """Queue a frame without waiting for the peer to take it (for small replies only)."""
        if self.closed:
            raise PeerClosed(f"pd connection to {self.peer} is closed: {self.close_reason}")
        body = self.encoder.encode(msg)
        if len(body) > self.max_frame_bytes:
            # refused here, so that one oversize message fails alone instead of the whole connection
            raise ValueError(f"{type(msg).__name__} of {len(body)} bytes exceeds the frame limit of "
                             f"{self.max_frame_bytes}")
        self.writer.write(HEADER.pack(len(body)) + body)
        self.last_sent = asyncio.get_running_loop().time()

    async def send(self, msg: Any) -> None:
        """Send a frame; waits while the peer's socket is full (that is the backpressure)."""
        self.send_nowait(msg)
        await self.writer.drain()

    async def recv(self, timeout: float | None = None) -> Any:
        """The next message other than Ping / Pong (Ping is answered here).

        timeout: seconds without any byte from the peer before PeerSilent (default: 3 heartbeats).
        Any error closes the connection before it is raised.
        """
        timeout = SILENT_AFTER_INTERVALS * self.heartbeat_interval if timeout is None else timeout
        if self.closed:
            raise PeerClosed(f"pd connection to {self.peer} is closed: {self.close_reason}")
        try:
            while True:
                msg = await self._read_message(timeout)
                if isinstance(msg, Ping):
                    # no drain: a peer that pings but does not read must not stall this read loop
                    self.send_nowait(Pong())
                elif not isinstance(msg, Pong):
                    return msg
        except ConnectionError as exc:
            # abort: nothing more is owed to this peer, and a send stuck on a full socket must end too
            self.close(str(exc), abort=True)
            raise

    async def _read_message(self, timeout: float) -> Any:
        (size,) = HEADER.unpack(await self._read_exactly(HEADER.size, timeout, mid_frame=False))
        if size > self.max_frame_bytes:
            raise ProtocolError(f"frame of {size} bytes from {self.peer} exceeds the limit of "
                                f"{self.max_frame_bytes} (not a Tandem prefill/decode peer?)")
        body = await self._read_exactly(size, timeout, mid_frame=True)
        try:
            return self.decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable frame from {self.peer}: {exc}") from exc

    async def _read_exactly(self, size: int, timeout: float, mid_frame: bool) -> bytes:
        """size bytes; PeerSilent when no byte arrives for timeout s (a large frame may take longer)."""
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

    def close(self, reason: str, *, abort: bool = False) -> None:
        """Close once, logging why (the first reason is kept).

        abort: drop what is still queued for the peer and end at once (waiting sends raise);
        otherwise queued frames (a Refused) are delivered first.
        """
        if self.closed:
            return
        self.close_reason = reason
        log.info("pd connection to %s closed: %s", self.peer, reason)
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


def _peer_name(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


# ---- handshake -------------------------------------------------------------------

OPPOSITE_ROLE = {"prefill": "decode", "decode": "prefill"}


async def handshake(conn: PdConnection, role: str, fingerprint: str, secret: bytes | None,
                    timeout: float) -> None:
    """Both sides: Hello, then (with a secret) Proof, then Welcome; each sends before it waits.

    Each side checks the other's Hello itself, so on a mismatch both refuse with the same reason.
    The refusing side sends Refused(reason) and closes; HandshakeRefused is raised on both sides.
    Everything must be done within timeout s: a silent peer is refused. A peer that sends what is
    not a frame raises the connection's own errors (ProtocolError, PeerClosed) instead.
    """
    steps = _Handshake(conn, role, fingerprint, secret, timeout)
    try:
        await asyncio.wait_for(steps.run(), timeout)
    except asyncio.TimeoutError:
        _refuse(conn, f"no {steps.awaiting} from the peer within {timeout:g} s")


class _Handshake:
    def __init__(self, conn: PdConnection, role: str, fingerprint: str, secret: bytes | None, timeout: float):
        if role not in OPPOSITE_ROLE:
            raise ValueError(f"role {role!r}: expected one of {sorted(OPPOSITE_ROLE)}")
        self.conn, self.role, self.fingerprint, self.secret = conn, role, fingerprint, secret
        self.nonce = secrets.token_bytes(NONCE_BYTES) if secret is not None else b""
        self.timeout = timeout
        self.awaiting = "Hello"

    async def run(self) -> None:
        await self.conn.send(Hello(PROTOCOL_VERSION, self.role, self.fingerprint, self.nonce))
        peer = await self.expect(Hello)
        reason = hello_mismatch(self.role, self.fingerprint, self.secret is not None, peer)
        if reason:
            _refuse(self.conn, reason)
        if self.secret is not None:
            await self.conn.send(Proof(proof_mac(self.secret, self.role, self.nonce, peer.nonce)))
            proof = await self.expect(Proof)
            expected = proof_mac(self.secret, peer.role, peer.nonce, self.nonce)
            if not hmac.compare_digest(proof.mac, expected):
                _refuse(self.conn, f"wrong secret: the {peer.role} node's proof does not match this node's "
                                   f"--pd-secret")
        await self.conn.send(Welcome())
        await self.expect(Welcome)

    async def expect(self, kind: type) -> Any:
        """The peer's next message, which must be `kind`; its Refused raises HandshakeRefused."""
        self.awaiting = kind.__name__
        # the handshake's own deadline (handshake()) ends this first; no heartbeats run yet
        msg = await self.conn.recv(timeout=2 * self.timeout)
        if isinstance(msg, Refused):
            self.conn.close(f"refused by the peer: {msg.reason}")
            raise HandshakeRefused(msg.reason, by_peer=True)
        if not isinstance(msg, kind):
            _refuse(self.conn, f"expected {kind.__name__} in the handshake, got {type(msg).__name__}")
        return msg


def hello_mismatch(role: str, fingerprint: str, has_secret: bool, peer: Hello) -> str | None:
    """What differs between this node and the peer's Hello (None: they pair)."""
    if peer.version != PROTOCOL_VERSION:
        return (f"protocol versions differ: this {role} node speaks {PROTOCOL_VERSION}, "
                f"the peer ({peer.role}) speaks {peer.version}")
    if peer.role != OPPOSITE_ROLE[role]:
        return f"roles do not pair: a {role} node needs a {OPPOSITE_ROLE[role]} peer, got {peer.role!r}"
    if peer.fingerprint != fingerprint:
        mine, theirs = _short(fingerprint), _short(peer.fingerprint)
        serves = {role: mine, peer.role: theirs}
        return f"model fingerprint differs: prefill serves {serves['prefill']}, decode {serves['decode']}"
    if has_secret != bool(peer.nonce):
        holder, other = (role, peer.role) if has_secret else (peer.role, role)
        return f"no secret: the {holder} node has a --pd-secret, the {other} node has none"
    if has_secret and len(peer.nonce) < NONCE_BYTES // 2:
        return f"the {peer.role} node's nonce is too short ({len(peer.nonce)} bytes)"
    return None


def proof_mac(secret: bytes, role: str, own_nonce: bytes, peer_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving `role` knows the secret, bound to both nonces of this handshake.

    The role is in the message so that a side's own proof reflected back to it does not pass;
    msgpack of the tuple keeps the fields unambiguous.
    """
    message = msgspec.msgpack.encode((PROOF_LABEL, role, own_nonce, peer_nonce))
    return hmac.new(secret, message, hashlib.sha256).digest()


def _short(fingerprint: str) -> str:
    return fingerprint[:16] if fingerprint else "(none)"


def _refuse(conn: PdConnection, reason: str) -> None:
    """Tell the peer why (if it still listens), close, raise."""
    try:
        conn.send_nowait(Refused(reason))
    except ConnectionError:
        pass                    # already closed: the reason is logged and raised here all the same
    conn.close(f"handshake refused: {reason}")
    raise HandshakeRefused(reason)


# ---- the shared secret -----------------------------------------------------------

def load_secret(value: str | None) -> bytes | None:
    """The --pd-secret flag's secret, or None without one.

    The rule: "@PATH" is always read from the file PATH; a value that is the path of an existing
    file is read from that file too; anything else is the secret itself. What a file holds is
    stripped of surrounding whitespace (a trailing newline). A file keeps the secret out of `ps`.
    """
    if not value:
        return None
    if value.startswith("@"):
        return _read_secret_file(value[1:])
    if os.path.isfile(value):
        return _read_secret_file(value)
    return value.encode()


def _read_secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--pd-secret: cannot read the secret file {path!r}: {exc.strerror}") from exc
    if not secret:
        raise ValueError(f"--pd-secret: the secret file {path!r} is empty")
    return secret
