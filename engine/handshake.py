"""The handshake that opens every link (engine/framing.py), and the shared secrets it proves.

Both sides send Hello (role, fingerprint, a nonce when a secret is configured), then with a secret a
Proof (an HMAC of the secret over both nonces: the secret never travels), then Welcome; each sends
before it waits. Each side checks the other's Hello itself, so on a mismatch both refuse with the
same reason, which names the fields that differ where the fingerprints have fields
(engine/fingerprint.py). The protocol version is in every frame's header, so a peer of another
version is refused by the framing before its Hello is read. Heartbeats start after the handshake.

| link                | roles           | secret flag   | fingerprint                          | heartbeats |
|---------------------|-----------------|---------------|--------------------------------------|------------|
| prefill/decode      | prefill, decode | --pd-secret   | a digest (server/pd/fingerprint.py)  | every 5 s  |
| front/rank over TCP | front, rank     | --rank-secret | fields (engine/fingerprint.py)       | every 5 s  |
| front/rank, unix    | front, rank     | --rank-secret | the same                             | none       |

After a front/rank handshake the rank loads its model and sends RankReady, whose resolved dtypes
the front compares with the other ranks' (server/rank_client.py). The TCP links are those of ranks
on other hosts: their heartbeats start once RankReady is sent (engine/rank_entry.py). Local ranks,
on a unix socket, are watched through their process instead.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
from typing import Any

import msgspec

from engine.fingerprint import differing_fields
from engine.framing import PROTOCOL_VERSION, Connection, Hello, Proof, Refusal, Welcome

NONCE_BYTES = 32
PROOF_LABEL = f"tandem-handshake-v{PROTOCOL_VERSION}"
OPPOSITE_ROLE = {"prefill": "decode", "decode": "prefill", "rank": "front", "front": "rank"}
SECRET_FLAG = {"prefill": "--pd-secret", "decode": "--pd-secret", "rank": "--rank-secret", "front": "--rank-secret"}


async def handshake(conn: Connection, role: str, fingerprint: str, secret: bytes | None, timeout: float) -> None:
    """Hello, then (with a secret) Proof, then Welcome; Refusal on both sides when they do not pair.

    Everything must be done within timeout s: a silent peer is refused. A peer that sends what is
    not a frame raises the connection's own errors (ProtocolError, PeerClosed) instead.
    """
    steps = _Handshake(conn, role, fingerprint, secret, timeout)
    try:
        await asyncio.wait_for(steps.run(), timeout)
    except asyncio.TimeoutError:
        refuse(conn, f"no {steps.awaiting} from the peer within {timeout:g} s")


class _Handshake:
    def __init__(self, conn: Connection, role: str, fingerprint: str, secret: bytes | None, timeout: float):
        if role not in OPPOSITE_ROLE:
            raise ValueError(f"role {role!r}: expected one of {sorted(OPPOSITE_ROLE)}")
        self.conn, self.role, self.fingerprint, self.secret = conn, role, fingerprint, secret
        self.nonce = secrets.token_bytes(NONCE_BYTES) if secret is not None else b""
        self.timeout = timeout
        self.awaiting = "Hello"

    async def run(self) -> None:
        await self.conn.send(Hello(self.role, self.fingerprint, self.nonce))
        peer = await self.expect(Hello)
        reason = hello_mismatch(self.role, self.fingerprint, self.secret is not None, peer)
        if reason:
            refuse(self.conn, reason)
        if self.secret is not None:
            await self.conn.send(Proof(proof_mac(self.secret, self.role, self.nonce, peer.nonce)))
            proof = await self.expect(Proof)
            expected = proof_mac(self.secret, peer.role, peer.nonce, self.nonce)
            if not hmac.compare_digest(proof.mac, expected):
                refuse(self.conn, f"wrong secret: the {peer.role} side's proof does not match this side's "
                                  f"{SECRET_FLAG[self.role]}")
        await self.conn.send(Welcome())
        await self.expect(Welcome)

    async def expect(self, kind: type) -> Any:
        """The peer's next message, which must be `kind` (its Refused raises Refusal in recv)."""
        self.awaiting = kind.__name__
        # the handshake's own deadline (handshake()) ends this first; no heartbeats run yet
        msg = await self.conn.recv(timeout=2 * self.timeout)
        if not isinstance(msg, kind):
            refuse(self.conn, f"expected {kind.__name__} in the handshake, got {type(msg).__name__}")
        return msg


def hello_mismatch(role: str, fingerprint: str, has_secret: bool, peer: Hello) -> str | None:
    """What differs between this side and the peer's Hello (None: they pair)."""
    if peer.role != OPPOSITE_ROLE[role]:
        return f"roles do not pair: a {role} side needs a {OPPOSITE_ROLE[role]} peer, got {peer.role!r}"
    if peer.fingerprint != fingerprint:
        return fingerprint_mismatch(role, fingerprint, peer)
    if has_secret != bool(peer.nonce):
        holder, other = (role, peer.role) if has_secret else (peer.role, role)
        return f"no secret: the {holder} side has a {SECRET_FLAG[role]}, the {other} side has none"
    if has_secret and len(peer.nonce) < NONCE_BYTES // 2:
        return f"the {peer.role} side's nonce is too short ({len(peer.nonce)} bytes)"
    return None


def fingerprint_mismatch(role: str, fingerprint: str, peer: Hello) -> str:
    """The same words on both sides, the prefill / front side first: the fields that differ where the
    fingerprints have fields, else both digests."""
    serves = {role: fingerprint, peer.role: peer.fingerprint}
    first, second = sorted(serves, key=lambda name: name not in ("prefill", "front"))
    differing = differing_fields(serves[first], serves[second])
    if differing:
        return "model fingerprint differs: " + "; ".join(f"{name}: {first} {ours}, {second} {theirs}"
                                                         for name, ours, theirs in differing)
    return f"model fingerprint differs: {first} serves {_short(serves[first])}, {second} {_short(serves[second])}"


def proof_mac(secret: bytes, role: str, own_nonce: bytes, peer_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving `role` knows the secret, bound to both nonces of this handshake.

    The role is in the message so that a side's own proof reflected back to it does not pass;
    msgpack of the tuple keeps the fields unambiguous.
    """
    message = msgspec.msgpack.encode((PROOF_LABEL, role, own_nonce, peer_nonce))
    return hmac.new(secret, message, hashlib.sha256).digest()


def _short(fingerprint: str) -> str:
    return fingerprint[:16] if fingerprint else "(none)"


def refuse(conn: Connection, reason: str) -> None:
    """Tell the peer why (if it still listens), close with the reason logged, raise Refusal."""
    conn.refuse(reason)
    raise Refusal(reason)


# ---- the shared secrets ----------------------------------------------------------

def load_secret(value: str | None, flag: str = "--pd-secret") -> bytes | None:
    """A secret flag's secret (--pd-secret, --rank-secret), or None without one.

    The rule: "@PATH" is always read from the file PATH; a value that is the path of an existing
    file is read from that file too; anything else is the secret itself. What a file holds is
    stripped of surrounding whitespace (a trailing newline). A file keeps the secret out of `ps`.
    """
    if not value:
        return None
    if value.startswith("@"):
        return _read_secret_file(value[1:], flag)
    if os.path.isfile(value):
        return _read_secret_file(value, flag)
    return value.encode()


def _read_secret_file(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read the secret file {path!r}: {exc.strerror}") from exc
    if not secret:
        raise ValueError(f"{flag}: the secret file {path!r} is empty")
    return secret
