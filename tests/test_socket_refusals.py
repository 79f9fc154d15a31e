"""Every socket Tandem listens on refuses what it must, through the listener the server itself runs:
the prefill node's bootstrap port (PrefillServer), the front's rank socket (a unix socket) and, with
--nnodes > 1, the front's rank port for the other hosts' ranks (TCP). Each refuses a frame of another
protocol version, a frame over the size limit (its body never sent: refused from the header alone),
and a peer without the secret or with a wrong one, each with a logged reason; the right secret pairs.
Real sockets on 127.0.0.1, every wait bounded."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from engine.args import parse_args
from engine.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, PROTOCOL_VERSION, Connection, Hello, Refusal, encode_frame
from engine.handshake import handshake, load_secret
from engine.messages import ToRank
from server.pd.messages import ToDecode
from server.pd.prefill_server import PrefillServer
from server.rank_client import RankEngineClient, remote_rank_address

WAIT = 10.0
SECRET = "the-right-secret"
MOE = str(Path(__file__).resolve().parent.parent / "models" / "tandem-moe")
READY = SimpleNamespace(dtype="float32", kv_dtype="float32", draft_weights=None)


@dataclass
class Listener:
    connect: Callable[[], Any]     # opens (reader, writer) to the socket
    role: str                      # the role a good peer plays
    fingerprint: str
    incoming: Any                  # the union that peer receives
    kind: str
    refusal_log: str               # how the listener logs a refused peer


@asynccontextmanager
async def bootstrap_port():
    args = parse_args(["--role", "prefill", "--speculative-algorithm", "none", "--pd-secret", SECRET,
                       "--disaggregation-bootstrap-port", "0"])
    server = PrefillServer(args, None, load_secret(args.pd_secret))
    await server.start([READY])
    port = server.server.sockets[0].getsockname()[1]
    try:
        yield Listener(lambda: asyncio.open_connection("127.0.0.1", port), "decode", server.fingerprint, ToDecode,
                       "pd", "refused a decode node at")
    finally:
        await server.close()


@asynccontextmanager
async def rank_listener(args, connect):
    client = RankEngineClient(args)
    await client.listen()
    try:
        yield Listener(lambda: connect(client), "rank", client.fingerprint, ToRank, "rank",
                       "refused a rank connection from")
    finally:
        for server in (client.server, client.remote_server):
            if server is not None:
                server.close()
        shutil.rmtree(client.socket_dir, ignore_errors=True)


def rank_socket():
    args = parse_args(["--speculative-algorithm", "none", "--rank-secret", SECRET])
    return rank_listener(args, lambda client: asyncio.open_unix_connection(client.socket_path))


def rank_port():
    port = free_port_pair()
    args = parse_args(["--model-path", MOE, "--enable-dp-attention", "--dp-size", "2", "--nnodes", "2",
                       "--dist-init-addr", f"127.0.0.1:{port}", "--rank-secret", SECRET])
    return rank_listener(args, lambda client: asyncio.open_connection("127.0.0.1", port + 1))


def free_port_pair() -> int:
    """A port whose next one is free too (the rank port is the rendezvous port + 1)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two free ports in a row")


LISTENERS = {"bootstrap-port": bootstrap_port, "rank-socket": rank_socket, "rank-port": rank_port}


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the listener sends until it closes the socket (a listener that keeps it open fails the wait)."""
    return await asyncio.wait_for(reader.read(), WAIT)


async def shake(listener: Listener, secret: bytes | None) -> Connection:
    reader, writer = await listener.connect()
    conn = Connection(reader, writer, listener.incoming, kind=listener.kind)
    try:
        await handshake(conn, listener.role, listener.fingerprint, secret, WAIT)
    except Refusal:
        await asyncio.wait_for(conn.wait_closed(), WAIT)
        raise
    return conn


async def logged(caplog, listener: Listener, reason: str) -> None:
    """The listener logged the refusal with its reason (it logs just after it closes the socket)."""
    for _ in range(100):
        if any(listener.refusal_log in record.getMessage() and reason in record.getMessage()
               for record in caplog.records):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no '{listener.refusal_log} ...: {reason}' in the log: "
                         f"{[record.getMessage() for record in caplog.records]}")


@pytest.fixture(params=LISTENERS.values(), ids=LISTENERS.keys())
async def listener(request, caplog):
    caplog.set_level("INFO")
    async with request.param() as opened:
        yield opened


async def test_a_frame_of_another_protocol_version_is_refused(listener, caplog):
    reader, writer = await listener.connect()
    writer.write(encode_frame(Hello(listener.role, listener.fingerprint, os.urandom(32)),
                              version=PROTOCOL_VERSION + 1))
    answer = await until_closed(reader)
    writer.close()
    assert HEADER.unpack(answer[:HEADER.size])[0] == PROTOCOL_VERSION         # its Hello, in its own version
    await logged(caplog, listener, "protocol versions differ")
    await logged(caplog, listener, f"version {PROTOCOL_VERSION + 1}, this side speaks {PROTOCOL_VERSION}")


async def test_a_frame_over_the_size_limit_is_refused_from_its_header(listener, caplog):
    reader, writer = await listener.connect()
    writer.write(HEADER.pack(PROTOCOL_VERSION, DEFAULT_MAX_FRAME_BYTES + 1))         # and never a body
    await until_closed(reader)
    writer.close()
    await logged(caplog, listener, f"frame of {DEFAULT_MAX_FRAME_BYTES + 1} bytes")


async def test_a_peer_without_the_secret_is_refused(listener, caplog):
    with pytest.raises(Refusal, match="no secret"):
        await shake(listener, None)
    await logged(caplog, listener, "no secret")


async def test_a_peer_with_a_wrong_secret_is_refused(listener, caplog):
    with pytest.raises(Refusal, match="wrong secret"):
        await shake(listener, b"not-the-secret")
    await logged(caplog, listener, "wrong secret")


async def test_the_right_secret_pairs(listener, caplog):
    conn = await shake(listener, SECRET.encode())
    assert not conn.closed
    conn.close("test over")
    await asyncio.wait_for(conn.wait_closed(), WAIT)
    assert not any(listener.refusal_log in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("secret,reason", [(b"not-the-secret", "wrong secret"), (None, "no secret")],
                         ids=["wrong", "missing"])
async def test_a_rank_started_with_another_secret_cannot_join(secret, reason):
    """The rank's own side (engine/rank_main.py's connect_front) proves the secret it was started with."""
    from engine.rank_main import connect_front
    client = RankEngineClient(parse_args(["--speculative-algorithm", "none", "--rank-secret", SECRET]))
    await client.listen()
    try:
        with pytest.raises(Refusal, match=reason):
            await asyncio.wait_for(connect_front(client.socket_path, secret, client.fingerprint), WAIT)
        conn = await asyncio.wait_for(connect_front(client.socket_path, SECRET.encode(), client.fingerprint), WAIT)
        assert not conn.closed
        conn.close("test over")
    finally:
        client.server.close()
        shutil.rmtree(client.socket_dir, ignore_errors=True)


RANK_LINKS = {"rank-socket": (["--speculative-algorithm", "none"], lambda client: client.socket_path),
              "rank-port": (["--model-path", MOE, "--enable-dp-attention", "--dp-size", "2", "--nnodes", "2"],
                            lambda client: "tcp://%s:%d" % remote_rank_address(client.args))}


@pytest.mark.parametrize("flag,value,expected", [("--quantization", "int8", "quantization: front none, rank int8"),
                                                 ("--page-size", "16", "page_size: front 1, rank 16")],
                         ids=["quantization", "page-size"])
@pytest.mark.parametrize("link", RANK_LINKS)
async def test_a_rank_started_with_other_flags_is_refused_naming_what_differs(link, flag, value, expected, caplog):
    """Both sides compute the fingerprint from their own flags (engine/fingerprint.py); each refuses
    the other with the same reason, which names the flag that differs. A TCP link runs heartbeats."""
    from engine.fingerprint import rank_fingerprint
    from engine.rank_entry import RANK_HEARTBEAT_INTERVAL_S
    from engine.rank_main import connect_front
    caplog.set_level("INFO")
    common, address = RANK_LINKS[link]
    if link == "rank-port":
        common = [*common, "--dist-init-addr", f"127.0.0.1:{free_port_pair()}"]
    client = RankEngineClient(parse_args([*common, "--rank-secret", SECRET]))
    other = rank_fingerprint(parse_args([*common, "--rank-secret", SECRET, flag, value]))
    await client.listen()
    try:
        with pytest.raises(Refusal, match=expected):
            await asyncio.wait_for(connect_front(address(client), SECRET.encode(), other), WAIT)
        listener = Listener(None, "rank", client.fingerprint, ToRank, "rank", "refused a rank connection from")
        await logged(caplog, listener, expected)
        conn = await asyncio.wait_for(connect_front(address(client), SECRET.encode(), client.fingerprint), WAIT)
        assert conn.heartbeat_interval == (RANK_HEARTBEAT_INTERVAL_S if link == "rank-port" else None)
        conn.close("test over")
    finally:
        for server in (client.server, client.remote_server):
            if server is not None:
                server.close()
        shutil.rmtree(client.socket_dir, ignore_errors=True)
