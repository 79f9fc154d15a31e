"""The framing of every socket (engine/framing.py) and its handshake (engine/handshake.py), on their
own: a pair of Connections over a real TCP socket on 127.0.0.1, or one Connection against a raw
socket that writes and reads bytes itself. Every wait is bounded."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from contextlib import asynccontextmanager

import msgspec
import pytest

from engine.framing import (HEADER, PROTOCOL_VERSION, Connection, Hello, PeerClosed, PeerSilent, Ping, ProtocolError,
                            Refusal, Refused, decoder_of, encode_frame)
from engine.handshake import PROOF_LABEL, handshake, hello_mismatch, proof_mac
from engine.messages import AbortRequest, FromRank, RankReady, ToRank

WAIT = 5.0
LIMIT = 4096


@asynccontextmanager
async def socket_pair():
    """(accepted reader/writer, connected reader/writer) of one TCP connection on 127.0.0.1."""
    accepted: asyncio.Queue = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: accepted.put_nowait((r, w)), "127.0.0.1", 0)
    client = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    served = await asyncio.wait_for(accepted.get(), WAIT)
    try:
        yield served, client
    finally:
        for _, writer in (served, client):
            writer.transport.abort()
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def connections(heartbeat_interval: float | None = None):
    """A front-side and a rank-side Connection of one socket."""
    async with socket_pair() as (served, client):
        front = Connection(*served, FromRank, kind="rank", max_frame_bytes=LIMIT,
                           heartbeat_interval=heartbeat_interval)
        rank = Connection(*client, ToRank, kind="rank", max_frame_bytes=LIMIT, heartbeat_interval=heartbeat_interval)
        yield front, rank


async def read_raw_frames(reader: asyncio.StreamReader) -> list[tuple[int, bytes]]:
    """(version, body) of every frame until EOF, read by hand from the header layout."""
    frames = []
    while True:
        try:
            header = await asyncio.wait_for(reader.readexactly(6), WAIT)
        except asyncio.IncompleteReadError:
            return frames
        version, size = struct.unpack(">HI", header)
        frames.append((version, await reader.readexactly(size)))


async def test_a_frame_is_the_version_and_length_then_the_msgpack_body():
    async with socket_pair() as (served, client):
        conn = Connection(*served, FromRank, kind="rank")
        message = AbortRequest("r1", "stop")
        await conn.send(message)
        conn.close("sent")
        frames = await read_raw_frames(client[0])
    assert frames == [(PROTOCOL_VERSION, msgspec.msgpack.encode(message))]


async def test_messages_travel_both_ways_and_ping_is_answered_unseen():
    ready = RankReady(rank=1, kv_total=64, context_length=128, description="test", dtype="float32")
    async with connections() as (front, rank):
        await rank.send(Ping())
        await rank.send(ready)
        assert await asyncio.wait_for(front.recv(), WAIT) == ready
        await front.send(AbortRequest("r1"))
        assert await asyncio.wait_for(rank.recv(), WAIT) == AbortRequest("r1")     # the Pong was not returned


@pytest.mark.parametrize("header,reason", [
    (HEADER.pack(PROTOCOL_VERSION + 1, 10), f"sent a frame of version {PROTOCOL_VERSION + 1}"),
    (HEADER.pack(PROTOCOL_VERSION, LIMIT + 1), f"frame of {LIMIT + 1} bytes"),
], ids=["wrong-version", "oversize"])
async def test_a_bad_header_is_refused_before_its_body_is_read(header, reason, caplog):
    """Only the header is sent: a side that waited for the body would wait until the test's bound."""
    caplog.set_level("INFO", logger="tandem.rank")
    async with socket_pair() as (served, client):
        conn = Connection(*served, FromRank, kind="rank", max_frame_bytes=LIMIT)
        client[1].write(header)
        with pytest.raises(ProtocolError, match=reason):
            await asyncio.wait_for(conn.recv(), WAIT)
        frames = await read_raw_frames(client[0])            # the peer is told why, then the socket closes
    assert conn.closed
    assert [decoder_of(ToRank).decode(body) for _, body in frames] == [Refused(conn.close_reason.removeprefix(
        "refused: "))]
    assert any(record.levelname == "WARNING" and reason in record.getMessage() for record in caplog.records)


async def test_a_refused_frame_from_the_peer_raises_its_reason():
    async with connections() as (front, rank):
        await front.send(Refused("the front is shutting down"))
        with pytest.raises(Refusal) as refusal:
            await asyncio.wait_for(rank.recv(), WAIT)
    assert refusal.value.by_peer and refusal.value.reason == "the front is shutting down" and rank.closed


async def test_a_link_without_heartbeats_waits_past_any_silence_and_one_with_them_does_not():
    async with connections() as (front, rank):
        waiting = asyncio.create_task(front.recv())
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await rank.send(RankReady(rank=0, kv_total=1, context_length=1, description="", dtype="float32"))
        assert isinstance(await asyncio.wait_for(waiting, WAIT), RankReady)
    async with connections(heartbeat_interval=0.1) as (front, _):
        with pytest.raises(PeerSilent):
            await asyncio.wait_for(front.recv(), WAIT)


@pytest.mark.parametrize("secret", [None, b"rank-secret"], ids=["no-secret", "secret"])
async def test_a_front_and_a_rank_pair(secret):
    async with connections() as (front, rank):
        await asyncio.wait_for(asyncio.gather(handshake(front, "front", "", secret, WAIT),
                                              handshake(rank, "rank", "", secret, WAIT)), WAIT)
        await front.send(AbortRequest("after"))
        assert await asyncio.wait_for(rank.recv(), WAIT) == AbortRequest("after")


@pytest.mark.parametrize("front_secret,rank_secret,reason", [
    (b"one", b"two", "wrong secret"), (b"one", None, "no secret: the front side has a --rank-secret"),
], ids=["wrong", "missing"])
async def test_a_rank_without_the_front_s_secret_is_refused_on_both_sides(front_secret, rank_secret, reason):
    async with connections() as (front, rank):
        results = await asyncio.wait_for(asyncio.gather(handshake(front, "front", "", front_secret, WAIT),
                                                        handshake(rank, "rank", "", rank_secret, WAIT),
                                                        return_exceptions=True), WAIT)
    assert all(isinstance(error, Refusal) and reason in error.reason for error in results), results
    assert front.closed and rank.closed


def test_roles_pair_only_with_their_opposite():
    assert hello_mismatch("front", "", False, Hello("rank", "")) is None
    assert hello_mismatch("prefill", "", False, Hello("decode", "")) is None
    assert "roles do not pair" in hello_mismatch("front", "", False, Hello("decode", ""))
    assert "roles do not pair" in hello_mismatch("rank", "", False, Hello("rank", ""))


def test_the_proof_is_an_hmac_of_both_nonces_bound_to_the_role():
    secret, mine, theirs = b"k", b"a" * 32, b"b" * 32
    reference = hmac.new(secret, msgspec.msgpack.encode((PROOF_LABEL, "rank", mine, theirs)), hashlib.sha256).digest()
    assert proof_mac(secret, "rank", mine, theirs) == reference
    assert proof_mac(secret, "front", mine, theirs) != reference        # a reflected proof does not pass
    assert proof_mac(secret, "rank", theirs, mine) != reference
    assert proof_mac(b"other", "rank", mine, theirs) != reference


def test_encode_frame_names_any_version():
    frame = encode_frame(Ping(), version=7)
    assert HEADER.unpack(frame[:HEADER.size]) == (7, len(frame) - HEADER.size)


@pytest.mark.parametrize("heartbeat_interval", [None, 5.0], ids=["without-heartbeats", "with-heartbeats"])
async def test_eof_is_peer_closed_between_and_inside_frames(heartbeat_interval):
    for payload, where in [(b"", "between frames"), (HEADER.pack(PROTOCOL_VERSION, 10) + b"abc",
                                                     "in the middle of a frame")]:
        async with socket_pair() as (served, client):
            conn = Connection(*served, FromRank, kind="rank", heartbeat_interval=heartbeat_interval)
            client[1].write(payload)
            client[1].close()
            with pytest.raises(PeerClosed, match=where):
                await asyncio.wait_for(conn.recv(), WAIT)
            assert conn.closed
