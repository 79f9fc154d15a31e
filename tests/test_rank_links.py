"""The front <-> rank links of ranks on other hosts (--nnodes 2, TCP), through real processes and
sockets on 127.0.0.1, every wait bounded: a host started with another --quantization or --page-size
is refused at the handshake, the reason (naming the flag) logged by both hosts, and the running
group serves on; a remote rank that goes silent (SIGSTOP) is noticed by the heartbeats within their
bound, its group's requests fail with an error, and once it runs again its host starts it anew and
the group comes back. In-process: the front's side of a silent rank and of one that only answers
Pings, with short heartbeats."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import shutil
import time
import urllib.request
from types import SimpleNamespace

import aiohttp
import pytest

from engine.args import parse_args
from engine.fingerprint import differing_fields, rank_fingerprint
from engine.messages import RankReady, SamplingParams
from engine.framing import SILENT_AFTER_INTERVALS, Refusal
from engine.rank_entry import RANK_HEARTBEAT_INTERVAL_S
from server.engine_client import EngineDead
from server.rank_client import RankEngineClient, remote_rank_address, resolved_mismatch
from tests.server_harness import DENSE, MOE, Server, free_port, metric, running_server

SECRET = "shared-by-both-hosts"
WAIT = 10.0
SHORT_HEARTBEAT_S = 0.2
SILENT_S = SILENT_AFTER_INTERVALS * RANK_HEARTBEAT_INTERVAL_S
COLLECTIVE_TIMEOUT_S = 30.0       # engine/dp.py: without heartbeats, the others' collectives fail only then
GROUP = ["--model-path", str(MOE), "--chunked-prefill-size", "32", "--speculative-algorithm", "none",
         "--enable-dp-attention", "--dp-size", "2", "--nnodes", "2", "--rank-secret", SECRET,
         "--max-rank-restarts", "10"]


# ---- what the fingerprint covers ----------------------------------------------------------------------

def fields(*flags: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in rank_fingerprint(parse_args(["--speculative-algorithm", "none",
                                                                           *flags])).split())


@pytest.mark.parametrize("flags,field", [
    (["--quantization", "int8"], "quantization"), (["--dtype", "bfloat16"], "dtype"),
    (["--page-size", "16"], "page_size"), (["--context-length", "1024"], "context_length"),
    (["--speculative-algorithm", "ngram"], "speculative"),
    (["--speculative-algorithm", "eagle", "--speculative-draft-model-path", str(DENSE) + "-eagle3"], "draft"),
    (["--speculative-algorithm", "eagle", "--speculative-num-steps", "2"], "speculative"),
    (["--speculative-algorithm", "eagle", "--speculative-draft-quantization", "int8"], "draft_quantization"),
    (["--dp-size", "2"], "dp_size"), (["--model-path", str(MOE)], "model")])
def test_the_rank_fingerprint_names_each_flag_that_changes_what_a_rank_computes(flags, field):
    eagle = ["--speculative-algorithm", "eagle"] if "eagle" in flags else []
    base = rank_fingerprint(parse_args(["--speculative-algorithm", "none", *eagle]))
    other = rank_fingerprint(parse_args(["--speculative-algorithm", "none", *flags]))
    assert [name for name, _, _ in differing_fields(base, other)] == [field]


def test_the_rank_fingerprint_leaves_out_what_differs_by_design_and_reads_no_weights(tmp_path, monkeypatch):
    copy = tmp_path / "elsewhere"
    shutil.copytree(DENSE, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    assert fields() == fields("--model-path", str(copy), "--cpu-kernels", "torch", "--max-running-requests", "8",
                              "--chunked-prefill-size", "64", "--disable-radix-cache", "--node-rank", "0")
    assert opened and not any(path.endswith(".safetensors") for path in opened)      # config.json only
    assert fields("--quantization", "int8")["quantization"] == "int8" and fields()["dtype"] == "auto"


def test_digests_have_no_fields_to_name():
    assert differing_fields("0123456789abcdef", "fedcba9876543210") == []
    assert differing_fields("a=1 b=2", "a=1 b=3 c=4") == [("b", "2", "3"), ("c", "-", "4")]


def ready(rank: int, dtype: str = "float32", **changes) -> RankReady:
    return RankReady(rank=rank, kv_total=1024, context_length=512, description="test", dtype=dtype, **changes)


def test_what_ranks_resolved_is_compared_dtype_kv_dtype_and_draft_quantization():
    assert resolved_mismatch(ready(1), [ready(0)]) is None
    assert resolved_mismatch(ready(1, kv_dtype="float32"), [ready(0)]) is None       # "": as the dtype
    reason = resolved_mismatch(ready(1, "bfloat16"), [ready(0)])
    assert "dtype: rank 0 float32, rank 1 bfloat16" in reason and "KV dtype: rank 0 float32, rank 1 bfloat16" in reason
    reason = resolved_mismatch(ready(1), [ready(0, draft_weights="int8")])
    assert reason.endswith("draft quantization: rank 0 int8, rank 1 none")


# ---- in process: the front's side, with short heartbeats ------------------------------------------

@contextlib.asynccontextmanager
async def front_of_two_hosts(monkeypatch):
    """A front of a two-host group (its own rank 0 not started), with short heartbeats; yields it and a
    coroutine function that connects as its rank 1, of "another host", the way rank_main does."""
    from engine.rank_main import connect_front
    monkeypatch.setattr("server.rank_client.RANK_HEARTBEAT_INTERVAL_S", SHORT_HEARTBEAT_S)
    args = parse_args([*GROUP, "--dist-init-addr", f"127.0.0.1:{free_port(span=2)}"])
    front = RankEngineClient(args)
    await front.listen()
    address = "tcp://%s:%d" % remote_rank_address(args)
    try:
        yield front, lambda: asyncio.wait_for(connect_front(address, SECRET.encode(), rank_fingerprint(args)), WAIT)
    finally:
        await front.close()
        shutil.rmtree(front.socket_dir, ignore_errors=True)


async def test_a_rank_that_resolved_another_dtype_is_refused_and_its_start_fails(monkeypatch):
    """--dtype auto resolves on each host (by its CPU): the front compares what each RankReady says
    with the ranks already in, and refuses the odd one with the reason on both sides."""
    async with front_of_two_hosts(monkeypatch) as (front, connect):
        loop = asyncio.get_running_loop()
        front.links[0].connected = loop.create_future()
        front.links[0].connected.set_result((SimpleNamespace(closed=False), ready(0, "float32")))
        front.links[1].connected = loop.create_future()
        rank = await connect()
        await rank.send(ready(1, "bfloat16"))
        with pytest.raises(Refusal, match="dtype: rank 0 float32, rank 1 bfloat16"):
            await asyncio.wait_for(rank.recv(), WAIT)
        with pytest.raises(RuntimeError, match="rank 1 was refused: .*KV dtype: rank 0 float32, rank 1 bfloat16"):
            await asyncio.wait_for(front.links[1].connected, WAIT)            # what bring_up awaits
        assert front.ranks_up() == 0


@contextlib.asynccontextmanager
async def front_with_remote_rank(monkeypatch):
    """A front of two hosts whose rank 1 is this test, attached as the front's bring_up attaches it;
    yields (front, the rank's connection)."""
    async with front_of_two_hosts(monkeypatch) as (front, connect):
        link = front.links[1]
        link.connected = asyncio.get_running_loop().create_future()
        rank = await connect()
        try:
            await rank.send(ready(1))
            await asyncio.wait_for(asyncio.shield(link.connected), WAIT)
            front.attach(link)
            yield front, rank
        finally:
            rank.close("test over")


async def test_a_remote_rank_that_goes_silent_is_taken_down_and_its_requests_fail(monkeypatch, caplog):
    caplog.set_level("INFO")
    async with front_with_remote_rank(monkeypatch) as (front, rank):
        stream = front.generate("r1", [1, 2, 3], SamplingParams(max_new_tokens=4))
        start = time.monotonic()
        with pytest.raises(EngineDead, match=r"rank 1 died: connection lost \(PeerSilent: nothing from"):
            await asyncio.wait_for(stream.__anext__(), WAIT)     # the rank reads nothing: no Pong, no token
        assert time.monotonic() - start < SILENT_AFTER_INTERVALS * SHORT_HEARTBEAT_S + 2.0
        assert not front.links[1].alive and front.ranks_up() == 0 and not front.is_healthy()


async def test_a_remote_rank_that_answers_pings_stays_up_through_a_long_silence_of_its_own(monkeypatch):
    """Heartbeats, not traffic, keep a link: a rank busy with a long step sends nothing else."""
    async with front_with_remote_rank(monkeypatch) as (front, rank):
        reader = asyncio.create_task(rank.recv())          # answers each Ping inside recv
        await asyncio.sleep(4 * SILENT_AFTER_INTERVALS * SHORT_HEARTBEAT_S)
        assert front.links[1].alive and not reader.done()
        reader.cancel()


async def test_a_rank_answers_pings_while_its_cpu_stream_runs_a_long_step():
    """The heartbeat interval rests on this: a launched step runs in the CPU stream's thread, and the
    rank's loop, whose reader answers Pings, stays free (torch releases the GIL inside its ops). The
    front's side here pings every 0.5 s and gives up after 1.5 s of silence; the step takes 3 s."""
    import socket

    import torch

    from devices.cpu import CpuDevice
    from engine.framing import Connection
    from engine.messages import FromRank, ToRank

    def long_step(seconds: float = 3.0) -> None:
        x, start = torch.randn(256, 256), time.perf_counter()
        while time.perf_counter() - start < seconds:     # many short ops: the GIL changes hands between them
            x = torch.tanh(x @ x)

    front_sock, rank_sock = socket.socketpair()
    front = Connection(*await asyncio.open_connection(sock=front_sock), FromRank, kind="rank", heartbeat_interval=0.5)
    rank = Connection(*await asyncio.open_connection(sock=rank_sock), ToRank, kind="rank")
    device = CpuDevice()
    tasks = [asyncio.create_task(front.keepalive()), asyncio.create_task(rank.recv())]
    front_reader = asyncio.create_task(front.recv())       # PeerSilent once no Pong comes for 1.5 s
    try:
        launched, ticks = device.launch(long_step), [time.monotonic()]
        while not launched.future.done():
            await asyncio.sleep(0.05)
            ticks.append(time.monotonic())
        await launched.future
        assert len(ticks) > 20 and max(b - a for a, b in zip(ticks, ticks[1:])) < 1.0       # the loop ran all along
        assert not front_reader.done()            # and the front never waited 1.5 s for a Pong
    finally:
        for task in [*tasks, front_reader]:
            task.cancel()
        device.close()
        front.close("test over")
        rank.close("test over")


# ---- real hosts: two launches of run.py, and more for the refused ones -----------------------------

@contextlib.contextmanager
def two_hosts(tmp_path):
    """Node 1 (rank 1) and node 0 (the front and rank 0), healthy; yields (node0, node1)."""
    addr = f"127.0.0.1:{free_port(span=2)}"              # node 0 takes the other hosts' ranks on port + 1
    node1 = Server([*GROUP, "--dist-init-addr", addr, "--node-rank", "1"], tmp_path / "node1.log")
    try:
        with running_server([*GROUP, "--dist-init-addr", addr, "--node-rank", "0"], tmp_path / "node0.log") as node0:
            node0.addr = addr
            yield node0, node1
    finally:
        node1.stop()


def wait_exit(server: Server, timeout: float) -> int:
    try:
        return server.process.wait(timeout)
    except Exception:
        raise AssertionError(f"still running after {timeout} s:\n{server.log.read_text()[-3000:]}") from None


def ranks_up(server: Server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        return metric(response.read().decode(), "tandem_ranks_up")


async def generate(session, url: str, max_new_tokens: int) -> int:
    body = {"text": "def parse(text):\n", "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                              "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as resp:
        await resp.read()
        return resp.status


@pytest.mark.slow
async def test_a_host_started_with_other_flags_is_refused_and_the_group_serves_on(tmp_path):
    cases = {"quantization": (["--quantization", "int8"], "quantization: front none, rank int8"),
             "page-size": (["--page-size", "16"], "page_size: front 1, rank 16")}
    with two_hosts(tmp_path) as (node0, _):
        intruders = {name: Server([*GROUP, "--dist-init-addr", node0.addr, "--node-rank", "1", *flags],
                                  tmp_path / f"{name}.log") for name, (flags, _) in cases.items()}
        try:
            codes = {name: await asyncio.to_thread(wait_exit, server, 120) for name, server in intruders.items()}
        finally:
            for server in intruders.values():
                server.stop()
        front_log = node0.log.read_text()
        for name, (_, reason) in cases.items():
            host_log = intruders[name].log.read_text()
            assert codes[name] == 1, host_log[-3000:]
            assert f"the front refused this rank: model fingerprint differs: {reason}" in host_log
            assert "not starting them again" in host_log
            assert re.search(rf"refused a rank connection from 127\.0\.0\.1:\d+: .*{re.escape(reason)}", front_log)
        assert ranks_up(node0) == 2                              # neither took rank 1's place
        async with aiohttp.ClientSession() as session:
            assert await generate(session, node0.url, 8) == 200


@pytest.mark.slow
async def test_a_stopped_remote_rank_is_noticed_by_heartbeats_and_the_group_comes_back(tmp_path):
    with two_hosts(tmp_path) as (node0, node1):
        [remote] = node1.rank_pids()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=COLLECTIVE_TIMEOUT_S + 30)) as session:
            jobs = [asyncio.create_task(generate(session, node0.url, 1500)) for _ in range(2)]
            await asyncio.sleep(2.0)
            assert not any(job.done() for job in jobs)
            os.kill(remote, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                statuses = await asyncio.wait_for(asyncio.gather(*jobs), COLLECTIVE_TIMEOUT_S + 20)
                noticed = time.monotonic() - stopped
            finally:
                os.kill(remote, signal.SIGCONT)       # it finds its link and group gone; its host starts it anew
            assert statuses == [503, 503]
            died = re.findall(r"rank (\d) died \((.*)\)", node0.log.read_text())
            assert died[0][0] == "1" and "PeerSilent" in died[0][1], died        # the silent rank is named
            assert noticed < SILENT_S + 8 < COLLECTIVE_TIMEOUT_S
            await asyncio.to_thread(wait_group_back, node0, 180)
            assert await generate(session, node0.url, 8) == 200
        host_log = node1.log.read_text()
        ended = re.search(r"a rank ended \(exit code (\d+) \((.*)\)\); starting this host's ranks again", host_log)
        assert ended and ended.group(1) in ("4", "5"), host_log[-3000:]         # its link, or its group, broke


def wait_group_back(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, KeyError):
            if ranks_up(server) == 2:
                return
        time.sleep(0.5)
    raise AssertionError(f"the group did not come back in {timeout} s:\n{server.log.read_text()[-4000:]}")
