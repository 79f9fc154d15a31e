"""The prefill/decode link (engine/framing.py and engine/handshake.py as server/pd/ uses them): frames,
heartbeats, the handshake, tensors on the wire and model fingerprints, over real TCP sockets on 127.0.0.1.
The test server plays the prefill node (it receives ToPrefill), clients play decode nodes."""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import torch

from engine.framing import (HEADER, PROTOCOL_VERSION, Connection, Hello, PeerClosed, PeerSilent, Ping, ProtocolError,
                            Refusal, Refused, decoder_of, encode_frame)
from engine.handshake import NONCE_BYTES, handshake, load_secret
from engine.messages import KvLayer, PrefillDone, SamplingParams
from engine.wire_tensor import WireTensor, from_wire, to_wire
from server.pd.fingerprint import describe, model_fingerprint
from server.pd.messages import Busy, PrefillRequest, ToDecode, ToPrefill

MODELS = Path(__file__).resolve().parent.parent / "models"
FP = "0123456789abcdef"
MAX_FRAME = 1 << 20
HANDSHAKE_TIMEOUT = 2.0
WAIT = 5.0                      # bound on any single wait of a test


# ---- helpers ---------------------------------------------------------------------

OPEN_WRITERS: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def close_every_socket():
    """Every socket a test opened (either end) is closed, and its closing seen through, before its loop ends."""
    yield
    while OPEN_WRITERS:
        writer = OPEN_WRITERS.pop()
        writer.transport.abort()
        try:
            await asyncio.wait_for(writer.wait_closed(), WAIT)
        except (ConnectionError, OSError):
            pass


async def raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    OPEN_WRITERS.append(writer)
    return reader, writer


class PrefillServer:
    """A TCP server whose connections run `handler(conn)`; each connection's outcome (what the
    handler returned, or the exception it raised) lands in `outcomes`."""

    def __init__(self, handler):
        self.handler = handler
        self.outcomes: asyncio.Queue = asyncio.Queue()
        self.conns: list[Connection] = []
        self.tasks: set[asyncio.Task] = set()

    async def on_connect(self, reader, writer) -> None:
        self.tasks.add(asyncio.current_task())
        OPEN_WRITERS.append(writer)
        conn = Connection(reader, writer, ToPrefill, kind="pd", max_frame_bytes=MAX_FRAME, heartbeat_interval=5.0)
        self.conns.append(conn)
        try:
            outcome = await self.handler(conn)
        except Exception as exc:            # the outcome under test
            outcome = exc
        await self.outcomes.put((conn, outcome))

    async def outcome(self):
        return await asyncio.wait_for(self.outcomes.get(), WAIT)


@asynccontextmanager
async def prefill_server(handler):
    state = PrefillServer(handler)
    server = await asyncio.start_server(state.on_connect, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        for conn in state.conns:
            conn.close("test over", abort=True)      # a handler still reading ends with PeerClosed
        await asyncio.wait_for(asyncio.gather(*state.tasks), WAIT)
        await server.wait_closed()


@asynccontextmanager
async def silent_peer():
    """The port of a server that accepts connections and never reads nor sends."""
    server = await asyncio.start_server(lambda reader, writer: OPEN_WRITERS.append(writer), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def connect(port: int, heartbeat_interval: float = 5.0) -> Connection:
    reader, writer = await raw_connect(port)
    return Connection(reader, writer, ToDecode, kind="pd", max_frame_bytes=MAX_FRAME,
                      heartbeat_interval=heartbeat_interval)


def prefill_handshake(fingerprint=FP, secret=None, timeout=HANDSHAKE_TIMEOUT):
    async def handler(conn):
        await handshake(conn, "prefill", fingerprint, secret, timeout)
        return conn
    return handler


def serving_prefill(secret=None, timeout=HANDSHAKE_TIMEOUT):
    """Handshake, then answer every PrefillRequest with Busy until the connection ends."""
    async def handler(conn):
        await handshake(conn, "prefill", FP, secret, timeout)
        while True:
            msg = await conn.recv(timeout=WAIT)
            if isinstance(msg, PrefillRequest):
                await conn.send(Busy(msg.rid, "test"))
    return handler


def request(room: str) -> PrefillRequest:
    return PrefillRequest(rid=room, input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=4))


async def assert_serves(conn: Connection, room: str) -> None:
    await conn.send(request(room))
    reply = await conn.recv(timeout=WAIT)
    assert reply == Busy(room, "test")


async def raw_frames(reader: asyncio.StreamReader) -> list:
    """Every frame a raw socket receives until EOF, decoded as ToDecode."""
    frames, decoder = [], decoder_of(ToDecode)
    while True:
        try:
            _, size = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), WAIT))
        except asyncio.IncompleteReadError:
            return frames
        frames.append(decoder.decode(await reader.readexactly(size)))


async def decode_side(port, role="decode", fingerprint=FP, secret=None):
    conn = await connect(port)
    try:
        await handshake(conn, role, fingerprint, secret, HANDSHAKE_TIMEOUT)
    except Exception as exc:
        return conn, exc
    return conn, None


async def refused_on_both_sides(server_handler, **client) -> tuple[Refusal, Refusal]:
    async with prefill_server(server_handler) as server:
        client_conn, client_error = await decode_side(server.port, **client)
        server_conn, server_error = await server.outcome()
    assert isinstance(client_error, Refusal), client_error
    assert isinstance(server_error, Refusal), server_error
    assert client_conn.closed and server_conn.closed
    assert client_conn.writer.is_closing() and server_conn.writer.is_closing()
    return server_error, client_error


# ---- handshake -------------------------------------------------------------------

@pytest.mark.parametrize("secret", [None, b"s3cret"], ids=["no-secret", "secret"])
async def test_a_good_handshake_pairs_and_messages_flow_both_ways(secret):
    async with prefill_server(serving_prefill(secret)) as server:
        conn, error = await decode_side(server.port, secret=secret)
        assert error is None
        await assert_serves(conn, "room-1")
        await assert_serves(conn, "room-2")
        conn.close("done")
        await asyncio.wait_for(conn.wait_closed(), WAIT)
        _, outcome = await server.outcome()
        assert isinstance(outcome, PeerClosed) and "between frames" in str(outcome)


async def test_the_secret_never_travels_and_each_handshake_has_fresh_nonces():
    secret, seen = b"the-shared-secret-value", bytearray()

    def tapped(handler):
        async def tap_then_handle(conn):
            read = conn.reader.read

            async def recording_read(n):
                data = await read(n)
                seen.extend(data)
                return data
            conn.reader.read = recording_read
            return await handler(conn)
        return tap_then_handle

    received = []
    async with prefill_server(tapped(prefill_handshake(secret=secret))) as server:
        for _ in range(2):
            conn, error = await decode_side(server.port, secret=secret)
            assert error is None
            _, outcome = await server.outcome()
            assert isinstance(outcome, Connection)
            received.append(bytes(seen))
            seen.clear()
            conn.close("done")
    assert all(secret not in raw for raw in received)
    hellos = [decoder_of(ToPrefill).decode(raw[HEADER.size:HEADER.size + HEADER.unpack(raw[:HEADER.size])[1]])
              for raw in received]
    assert len(hellos[0].nonce) == NONCE_BYTES
    assert hellos[0].nonce != hellos[1].nonce           # a fresh nonce (and so a fresh proof) each time


async def test_wrong_version_is_refused_by_name_and_closed(caplog):
    caplog.set_level("INFO", logger="tandem.pd")
    async with prefill_server(prefill_handshake()) as server:
        reader, writer = await raw_connect(server.port)
        writer.write(encode_frame(Hello("decode", FP, b""), version=PROTOCOL_VERSION + 1))
        frames = await raw_frames(reader)     # ends at EOF: the server closed
        _, error = await server.outcome()
        writer.close()
    assert isinstance(error, ProtocolError)
    assert "protocol versions differ" in str(error) and f"version {PROTOCOL_VERSION + 1}" in str(error)
    assert isinstance(frames[0], Hello) and frames[1:] == [Refused(str(error))]
    assert any(record.name == "tandem.pd" and "protocol versions differ" in record.getMessage()
               for record in caplog.records)


async def test_wrong_role_is_refused_by_name_on_both_sides():
    server_error, client_error = await refused_on_both_sides(prefill_handshake(), role="prefill")
    for error in (server_error, client_error):
        assert "roles do not pair" in error.reason and "'prefill'" in error.reason


async def test_wrong_fingerprint_is_refused_naming_both_on_both_sides():
    server_error, client_error = await refused_on_both_sides(prefill_handshake(), fingerprint="fedcba9876543210")
    expected = f"model fingerprint differs: prefill serves {FP}, decode fedcba9876543210"
    assert server_error.reason == expected and client_error.reason == expected


async def test_wrong_secret_is_refused_on_both_sides():
    server_error, client_error = await refused_on_both_sides(prefill_handshake(secret=b"one"), secret=b"two")
    assert "wrong secret" in server_error.reason and "wrong secret" in client_error.reason


@pytest.mark.parametrize("server_secret,client_secret,holder", [(b"s", None, "prefill"), (None, b"s", "decode")],
                         ids=["prefill-only", "decode-only"])
async def test_a_secret_on_one_side_only_is_refused_on_both_sides(server_secret, client_secret, holder):
    server_error, client_error = await refused_on_both_sides(prefill_handshake(secret=server_secret),
                                                             secret=client_secret)
    for error in (server_error, client_error):
        assert error.reason.startswith("no secret") and f"the {holder} side has a --pd-secret" in error.reason


async def test_a_refusal_from_the_peer_is_raised_with_its_reason():
    async def refusing_prefill(conn):
        await conn.send(Hello("prefill", FP, b""))
        await conn.send(Refused("prefill node is draining"))
        return await conn.recv(timeout=WAIT)            # the decode side's Hello

    async with prefill_server(refusing_prefill) as server:
        conn, error = await decode_side(server.port)
        await server.outcome()
    assert isinstance(error, Refusal) and error.by_peer
    assert error.reason == "prefill node is draining" and conn.closed


async def test_a_silent_peer_is_refused_after_the_timeout():
    async with prefill_server(prefill_handshake(timeout=0.3)) as server:
        reader, writer = await raw_connect(server.port)
        started = time.monotonic()
        frames = await raw_frames(reader)      # the server's Hello, its Refused, then EOF
        elapsed = time.monotonic() - started
        _, error = await server.outcome()
        writer.close()
    assert isinstance(error, Refusal) and error.reason == "no Hello from the peer within 0.3 s"
    assert isinstance(frames[0], Hello) and frames[1:] == [Refused(error.reason)]
    assert 0.25 < elapsed < 1.5


# ---- malformed input -------------------------------------------------------------

GARBAGE = {   # what is sent, what the error says
    "http-request": (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "protocol versions differ"),  # "GE"
    "random-body": (HEADER.pack(PROTOCOL_VERSION, 64) + random.Random(7).randbytes(64), "undecodable frame"),
    "random-bytes": (random.Random(8).randbytes(256), "protocol versions differ"),
    "oversize-length": (HEADER.pack(PROTOCOL_VERSION, MAX_FRAME + 1) + b"x" * 16, "exceeds the limit"),
}


@pytest.mark.parametrize("garbage,error_says", GARBAGE.values(), ids=GARBAGE.keys())
async def test_garbage_closes_that_connection_and_others_keep_working(garbage, error_says, caplog):
    caplog.set_level("INFO", logger="tandem.pd")
    async with prefill_server(serving_prefill()) as server:
        good, error = await decode_side(server.port)
        assert error is None
        reader, writer = await raw_connect(server.port)
        writer.write(garbage)
        frames = await raw_frames(reader)           # returns at EOF: the server closed it
        bad_conn, outcome = await server.outcome()
        writer.close()
        assert isinstance(outcome, ProtocolError) and bad_conn.closed
        assert frames == [Hello("prefill", FP, b""), Refused(str(outcome))]     # told why, then closed
        assert error_says in str(outcome)
        await assert_serves(good, "still-here")
    assert any(record.name == "tandem.pd" and str(outcome) in record.getMessage() for record in caplog.records)


async def test_a_message_of_the_wrong_direction_is_a_protocol_error():
    async with prefill_server(serving_prefill()) as server:
        good, _ = await decode_side(server.port)
        bad, error = await decode_side(server.port)
        assert error is None
        # KvLayer travels prefill -> decode only
        await bad.send(KvLayer("r", 0, 1, 0, "target", to_wire(torch.zeros(2, 1, 2, 4))))
        _, outcome = await server.outcome()
        assert isinstance(outcome, ProtocolError) and "undecodable frame" in str(outcome)
        with pytest.raises(Refusal, match="undecodable frame"):
            await bad.recv(timeout=WAIT)                      # the server's Refused names what was wrong
        await assert_serves(good, "still-here")


async def test_eof_raises_peer_closed_between_and_inside_frames():
    async def recv_once(conn):
        return await conn.recv(timeout=WAIT)

    async with prefill_server(recv_once) as server:
        cut_short = HEADER.pack(PROTOCOL_VERSION, 10) + b"abc"
        for payload, where in [(b"", "between frames"), (cut_short, "in the middle of a frame")]:
            _, writer = await raw_connect(server.port)
            writer.write(payload)
            writer.close()
            conn, outcome = await server.outcome()
            assert isinstance(outcome, PeerClosed) and where in str(outcome) and conn.closed


async def test_sending_a_frame_over_the_limit_fails_alone():
    async with prefill_server(serving_prefill()) as server:
        conn, _ = await decode_side(server.port)
        huge = PrefillRequest("big", list(range(MAX_FRAME // 4)), SamplingParams())
        with pytest.raises(ValueError, match="exceeds the frame limit"):
            await conn.send(huge)
        await assert_serves(conn, "after")


# ---- heartbeats ------------------------------------------------------------------

async def test_heartbeats_keep_an_idle_connection_alive_past_the_silence_timeout():
    interval = 0.2

    async def pinging_prefill(conn):
        await handshake(conn, "prefill", FP, None, HANDSHAKE_TIMEOUT)
        pinger = asyncio.create_task(conn.keepalive(interval))
        try:
            msg = await conn.recv(timeout=3 * interval)      # only Pongs come for a while
            await conn.send(Busy(msg.rid, "test"))
            return msg
        finally:
            pinger.cancel()

    async with prefill_server(pinging_prefill) as server:
        conn, _ = await decode_side(server.port)
        # the decode side runs no keepalive of its own: it stays alive by the Pings and answers Pong
        reply = asyncio.create_task(conn.recv(timeout=3 * interval))
        await asyncio.sleep(8 * interval)                    # well past the silence timeout
        assert not reply.done() and not conn.closed
        await conn.send(request("late"))
        assert await asyncio.wait_for(reply, WAIT) == Busy("late", "test")
        _, outcome = await server.outcome()
        assert outcome == request("late")


async def test_a_peer_that_stops_answering_is_silent_within_three_intervals():
    interval = 0.2
    async with silent_peer() as port:
        conn = await connect(port, heartbeat_interval=interval)
        pinger = asyncio.create_task(conn.keepalive())
        started = time.monotonic()
        with pytest.raises(PeerSilent):
            await asyncio.wait_for(conn.recv(), WAIT)
        elapsed = time.monotonic() - started
        assert 2.5 * interval < elapsed < 5 * interval
        assert conn.closed
        await asyncio.wait_for(pinger, WAIT)                 # the keepalive ends with the connection


async def test_send_waits_while_the_peer_does_not_read_and_fails_once_it_is_given_up():
    async with silent_peer() as port:
        conn = await connect(port)
        chunk = KvLayer("r", 0, 1, 0, "target", WireTensor("bool", [MAX_FRAME // 2], b"\1" * (MAX_FRAME // 2)))

        async def stream_kv():
            for _ in range(64):                               # 32 MiB: more than the sockets buffer
                await conn.send(chunk)
        streaming = asyncio.create_task(stream_kv())
        await asyncio.sleep(1.0)
        assert not streaming.done()                           # held back by the peer that does not read
        with pytest.raises(PeerSilent):
            await conn.recv(timeout=0.1)
        with pytest.raises(ConnectionError):                  # giving up on the peer ends the waiting send
            await asyncio.wait_for(streaming, WAIT)


async def test_ping_is_answered_and_neither_ping_nor_pong_is_returned():
    async def ping_then_request(conn):
        await conn.send(Ping())
        await conn.send(request("x"))
        return await conn.recv(timeout=WAIT)

    async with prefill_server(ping_then_request) as server:
        conn = await connect(server.port)
        await conn.send(Ping())                              # answered by the server's recv
        await conn.send(request("y"))
        with pytest.raises(ProtocolError):
            await conn.recv(timeout=WAIT)                    # PrefillRequest is not a ToDecode message
        _, outcome = await server.outcome()
    assert outcome == request("y")


# ---- tensors and messages on the wire --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.int32, torch.bool])
def test_wire_tensor_round_trip(dtype):
    source = (torch.arange(2 * 3 * 2 * 4) - 7).reshape(2, 3, 2, 4).to(dtype)
    wire_form = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(source.transpose(1, 2))), type=WireTensor)
    back = from_wire(wire_form)
    assert back.dtype == dtype and back.shape == (2, 2, 3, 4)
    assert torch.equal(back, source.transpose(1, 2))


def test_wire_tensor_of_no_elements():
    assert from_wire(to_wire(torch.zeros(2, 0, 4))).shape == (2, 0, 4)


@pytest.mark.parametrize("bad,message", [
    (WireTensor("float32", [2, 3], b"\0" * 20), "needs 24 bytes, got 20"),
    (WireTensor("complex64", [1], b"\0" * 8), "dtype 'complex64'"),
    (WireTensor("float32", [-1, 2], b""), "must not be negative"),
], ids=["byte-count", "unknown-dtype", "negative-shape"])
def test_malformed_wire_tensor_is_a_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        from_wire(bad)


async def test_prefill_done_travels_intact():
    done = PrefillDone("room", kv_len=17, first_token=42, logprob=-0.5, top_logprobs=[(42, -0.5), (7, -2.0)],
                       draft_row={"hidden": to_wire(torch.randn(1, 8).to(torch.bfloat16))}, record={"k": [1, 2]})

    async def send_done(conn):
        await conn.send(done)

    async with prefill_server(send_done) as server:
        conn = await connect(server.port)
        got = await conn.recv(timeout=WAIT)
        await server.outcome()
    assert got == done and torch.equal(from_wire(got.draft_row["hidden"]), from_wire(done.draft_row["hidden"]))


@pytest.mark.parametrize("bad", [KvLayer("r", 0, 1, 0, "other", to_wire(torch.zeros(2, 1, 2, 4))),
                                 KvLayer("r", -1, 1, 0, "target", to_wire(torch.zeros(2, 1, 2, 4)))],
                         ids=["unknown-kind", "negative-start"])
async def test_a_message_with_an_invalid_field_is_a_protocol_error(bad):
    async def send_bad(conn):
        await conn.send(bad)

    async with prefill_server(send_bad) as server:
        conn = await connect(server.port)
        with pytest.raises(ProtocolError, match="undecodable frame"):
            await conn.recv(timeout=WAIT)
        await server.outcome()
    assert conn.closed


# ---- the secret flag -------------------------------------------------------------

def test_load_secret_from_value_at_file_or_existing_path(tmp_path):
    path = tmp_path / "pd.secret"
    path.write_text("  from-a-file\n")
    assert load_secret(None) is None and load_secret("") is None
    assert load_secret("plain-value") == b"plain-value"
    assert load_secret(f"@{path}") == b"from-a-file"
    assert load_secret(str(path)) == b"from-a-file"
    with pytest.raises(ValueError, match="cannot read the secret file"):
        load_secret(f"@{tmp_path / 'missing'}")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_secret(f"@{tmp_path / 'empty'}")


# ---- fingerprints ----------------------------------------------------------------

@pytest.fixture
def folders(tmp_path):
    """Copies of the embedded models' config.json files: the target (twice), its EAGLE and EAGLE-3 heads."""
    made = {}
    for name, source in [("target", "tandem-dense"), ("target-copy", "tandem-dense"),
                         ("eagle", "tandem-dense-eagle"), ("eagle3", "tandem-dense-eagle3")]:
        (tmp_path / name).mkdir()
        shutil.copy(MODELS / source / "config.json", tmp_path / name / "config.json")
        made[name] = str(tmp_path / name)
    return made


def fingerprint(folders, target="target", dtype="bfloat16", page=1, algo="eagle", steps=4, draft="eagle",
                quantization=None):
    return model_fingerprint(folders[target], dtype, page, algo, steps, folders[draft] if draft else None,
                             quantization)


def test_same_flags_and_folders_give_the_same_fingerprint(folders):
    assert fingerprint(folders) == fingerprint(folders)
    assert fingerprint(folders) == fingerprint(folders, target="target-copy")     # the path does not count
    config_path = Path(folders["target-copy"]) / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_version"] = "0.0.1"                                       # how it was saved: no
    config_path.write_text(json.dumps(dict(reversed(config.items())), indent=4))   # formatting: no
    assert fingerprint(folders) == fingerprint(folders, target="target-copy")
    assert len(fingerprint(folders)) == 16 and int(fingerprint(folders), 16) >= 0


def test_a_different_config_dtype_page_draft_or_chain_gives_a_different_fingerprint(folders):
    config_path = Path(folders["target-copy"]) / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    base = fingerprint(folders)
    variants = [fingerprint(folders, target="target-copy"), fingerprint(folders, dtype="float32"),
                fingerprint(folders, page=16), fingerprint(folders, algo="eagle3", draft="eagle3"),
                fingerprint(folders, draft="eagle3"), fingerprint(folders, steps=3),
                fingerprint(folders, algo="none", draft=None), fingerprint(folders, quantization="int8"),
                fingerprint(folders, quantization="int4")]
    assert base not in variants and len(set(variants)) == len(variants)
    assert fingerprint(folders, quantization="none") == base        # "none" and no flag are the same weights


def test_a_node_s_fingerprint_covers_its_weight_quantization():
    """The KV a node writes depends on its weights: a prefill node serving int8 weights and a decode
    node serving them unquantized must not pair."""
    from types import SimpleNamespace

    from engine.args import parse_args
    from server.pd.fingerprint import node_fingerprint
    readies = [SimpleNamespace(dtype="float32", kv_dtype="float32", draft_weights=None)]
    plain = node_fingerprint(parse_args(["--speculative-algorithm", "none"]), readies)
    int8 = node_fingerprint(parse_args(["--speculative-algorithm", "none", "--quantization", "int8"]), readies)
    assert plain != int8 and plain == node_fingerprint(parse_args(["--speculative-algorithm", "none"]), readies)


def test_the_kv_dtype_the_draft_s_quantization_and_the_token_map_count(folders, tmp_path):
    """What gives the KV bytes and the draft state their meaning: the KV cache's dtype, the draft's own
    weights (it writes the draft KV) and the token map (the draft state indexes it)."""
    token_map, other_map = tmp_path / "map.pt", tmp_path / "other.pt"
    token_map.write_bytes(b"ids 1 2 3")
    other_map.write_bytes(b"ids 1 2 4")
    base = fingerprint(folders)
    assert model_fingerprint(folders["target"], "bfloat16", 1, "eagle", 4, folders["eagle"], None,
                             kv_dtype="bfloat16", draft_quantization="none") == base     # the defaults spelled out
    variants = [model_fingerprint(folders["target"], "bfloat16", 1, "eagle", 4, folders["eagle"], None, **options)
                for options in ({"kv_dtype": "float32"}, {"draft_quantization": "int8"},
                                {"draft_quantization": "w8a8_int8"}, {"token_map": str(token_map)},
                                {"token_map": str(other_map)})]
    assert base not in variants and len(set(variants)) == len(variants)
    plain = model_fingerprint(folders["target"], "bfloat16", 1, "none", 0, None)
    assert plain == model_fingerprint(folders["target"], "bfloat16", 1, "none", 0, None, token_map=str(token_map),
                                      draft_quantization="int8")          # no speculation: no draft state to mean


def test_a_node_s_fingerprint_covers_what_its_ranks_resolved():
    """The ranks resolve the KV dtype and the draft's quantization (its auto depends on the CPU): two
    nodes with the same flags that resolved them differently must not pair."""
    from types import SimpleNamespace

    from engine.args import parse_args
    from server.pd.fingerprint import node_fingerprint
    args = parse_args(["--speculative-algorithm", "eagle"])

    def ready(**resolved):
        return [SimpleNamespace(**{"dtype": "float32", "kv_dtype": "float32", "draft_weights": None, **resolved})]
    base = node_fingerprint(args, ready())
    assert base == node_fingerprint(args, ready(kv_dtype=""))             # "": the KV is in the model's dtype
    assert base != node_fingerprint(args, ready(kv_dtype="bfloat16"))
    assert base != node_fingerprint(args, ready(draft_weights="int8"))


def test_without_speculation_the_chain_length_and_draft_do_not_count(folders):
    assert fingerprint(folders, algo="none", steps=4, draft=None) == fingerprint(folders, algo="none", steps=7,
                                                                                draft="eagle")


def test_describe_names_architecture_dtype_and_draft(folders):
    text = describe(folders["target"], "bfloat16", 1, "eagle", 4, folders["eagle"])
    assert text.startswith("LlamaForCausalLM bfloat16, page 1, eagle x4 with LlamaForCausalLMEagle")
    assert fingerprint(folders) in text


def test_a_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        model_fingerprint(str(tmp_path), "bfloat16", 1, "none", 0, None)



# ---- transports ----------------------------------------------------------------------

def test_the_transfer_backend_flag_picks_a_registered_transport(monkeypatch):
    """--disaggregation-transfer-backend names a transport in server/pd/transport.py's registry; both
    sides open their streams through it; an unknown name is refused before anything starts."""
    import subprocess
    import sys

    from engine.args import parse_args
    from server.pd import transport as transports
    from server.pd.prefill_links import PrefillLinks
    from server.pd.prefill_server import PrefillServer

    class Recording(transports.TcpTransport):
        name = "recording"
    monkeypatch.setitem(transports.TRANSPORTS, "recording", Recording)
    args = parse_args(["--role", "decode", "--prefill-addr", "127.0.0.1:1", "--disaggregation-transfer-backend",
                       "recording"])
    assert all(isinstance(link.transport, Recording) for link in PrefillLinks(args, None).links)
    args = parse_args(["--role", "prefill", "--disaggregation-transfer-backend", "recording"])
    assert isinstance(PrefillServer(args, None, None).transport, Recording)
    refused = subprocess.run([sys.executable, "run.py", "--disaggregation-transfer-backend", "rdma-someday"],
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert refused.returncode == 2 and "choose one of tcp" in refused.stderr
