"""The server survives what clients and the machine throw at it, through real processes, sockets
and signals: seeds at the edge of the documented range, a rank killed with SIGKILL (its clients
get errors, the rank comes back), the restart limit (the server exits non-zero), and SIGTERM
under load (requests finish or get an error, the trace is complete, exit 0, no process left)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from engine.faults import ENV
from engine.sampling import GENERATOR_SEED_MASK, generator_seed
from server.schemas import MAX_N, MAX_SEED
from tests.server_harness import Server, alive, metric, running_server

pytestmark = pytest.mark.slow
PROMPT = "def parse(text):\n"


def test_generator_seeds_stay_in_range_and_repeat():
    for seed in (0, 1, 10**12, MAX_SEED - MAX_N, MAX_SEED):
        derived = generator_seed(seed, position=1 << 24, salt=63)
        assert 0 <= derived <= GENERATOR_SEED_MASK
        assert derived == generator_seed(seed, position=1 << 24, salt=63)
    assert generator_seed(3, 7, 1) == (3 * 1_000_003 + 7) * 64 + 1           # small seeds: as before


async def complete(session, url: str, **body) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": 12, **body}
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("flags", [[], ["--speculative-algorithm", "none", "--disable-overlap-schedule"]],
                         ids=["eagle+overlap", "none-no-overlap"])
async def test_large_seeds_work_and_repeat(flags, tmp_path):
    top = MAX_SEED - MAX_N                          # the largest seed the API takes (n choices use seed + i)
    with running_server(flags, tmp_path / "seeds.log") as srv:
        async with aiohttp.ClientSession() as session:
            results = [await complete(session, srv.url, seed=seed, temperature=0.9, n=n)
                       for seed, n in ((10**12, 1), (top, 1), (top, MAX_N), (10**12, 1), (top, 1))]
            assert all(status == 200 for status, _ in results), results
            texts = [[c["text"] for c in body["choices"]] for _, body in results]
            assert texts[3] == texts[0] and texts[4] == texts[1]               # same seed, same text
            assert texts[2][0] == texts[1][0] and len(texts[2]) == MAX_N
            status, _ = await complete(session, srv.url, prompt="a", seed=top)
            assert status == 200                                             # the rank is still serving


async def stream_completion(session, url: str, max_tokens: int, prompt: str = PROMPT) -> dict:
    """A streamed completion: its text events, whether it ended with [DONE], and any error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    out = {"status": None, "events": [], "error": None, "done": False}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.json())["error"]
                return out
            async for line in resp.content:
                text = line.decode().strip()
                if text == "data: [DONE]":
                    out["done"] = True
                elif text.startswith("data: "):
                    event = json.loads(text[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    else:
                        out["events"].append(event)
    except aiohttp.ClientError as exc:
        out["error"] = {"message": f"connection: {exc!r}"}
    return out


def finished_whole(result: dict, max_tokens: int) -> bool:
    return (result["done"] and result["error"] is None
            and result["events"][-1]["choices"][0]["finish_reason"] == "length")


async def health(session, url: str) -> int:
    async with session.get(url + "/health") as resp:
        return resp.status


async def test_a_killed_rank_fails_only_its_requests_and_comes_back(tmp_path):
    with running_server(["--dp-size", "2", "--speculative-algorithm", "none"], tmp_path / "kill.log") as srv:
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(stream_completion(session, srv.url, 1500)) for _ in range(4)]
            await asyncio.sleep(2.0)                                   # every stream has started on a rank
            victim = srv.rank_pids()[0]
            assert not any(t.done() for t in streams)
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
            failed = [r for r in results if not finished_whole(r, 1500)]
            assert len(failed) == 2                                    # the victim's two, and only those
            assert all("died" in r["error"]["message"] for r in failed)
            assert await health(session, srv.url) == 200               # the other rank still serves
            pids = await asyncio.to_thread(srv.wait_ranks, 2)
            assert victim not in pids
            for pid in pids:                                           # now every rank at once
                os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            assert await health(session, srv.url) == 503
            status, body = await complete(session, srv.url)
            assert status == 503 and "restarting" in body["error"]["message"]
            await asyncio.to_thread(srv.wait_ranks, 2)
            status, body = await complete(session, srv.url)
            assert status == 200 and body["choices"][0]["text"]
            async with session.get(srv.url + "/metrics") as resp:
                assert metric(await resp.text(), "tandem_rank_restarts_total") == 3
    log = srv.log.read_text()
    assert log.count("killed by SIGKILL") == 3


async def test_too_many_rank_deaths_make_the_server_exit_non_zero(tmp_path, monkeypatch):
    """Every step fails (a broken device): a rank ends itself after 3 failed steps in a row; with
    --max-rank-restarts 1 the second death ends the server, with exit code 1."""
    monkeypatch.setenv(ENV, "step=1,times=1000000")
    srv = Server(["--speculative-algorithm", "none", "--max-rank-restarts", "1"], tmp_path / "broken.log")
    try:
        srv.wait_healthy()
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                [rank] = await asyncio.to_thread(srv.wait_ranks, 1)
                for _ in range(3):
                    status, body = await complete(session, srv.url)
                    assert status == 500 and "fault injected" in body["error"]["message"], body
                for _ in range(100):                                   # it ends itself
                    if not alive(rank):
                        break
                    await asyncio.sleep(0.1)
        code = await asyncio.to_thread(srv.process.wait, 60)
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert code == 1, log[-2000:]
    assert "exit code 3" in log and "giving up" in log


@pytest.mark.parametrize("timeout", [30.0, 0.5], ids=["requests-finish", "requests-cut"])
async def test_sigterm_under_load_drains_and_exits_cleanly(timeout, tmp_path):
    trace = tmp_path / "trace.json"
    max_tokens = 120 if timeout > 1 else 1900
    slow_steps = {ENV: "step=1,times=1000000,where=delay,seconds=0.05"}   # still draining when probed
    srv = Server(["--trace-file", str(trace), "--shutdown-timeout", str(timeout)], tmp_path / "term.log",
                 env=slow_steps)
    try:
        srv.wait_healthy()
        ranks = srv.rank_pids()
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(stream_completion(session, srv.url, max_tokens)) for _ in range(4)]
            await asyncio.sleep(1.0)
            os.killpg(srv.process.pid, signal.SIGTERM)                 # as systemd stops a service
            await asyncio.sleep(0.2)
            assert not any(s.done() for s in streams), "the streams ended before the probe: slow the steps"
            status, body = await complete(session, srv.url)
            assert status == 503 and "shutting down" in body["error"]["message"]
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        code = await asyncio.to_thread(srv.process.wait, 60)
    finally:
        srv.stop()
    assert code == 0, srv.log.read_text()[-2000:]
    if timeout > 1:
        assert all(finished_whole(r, max_tokens) for r in results)
    else:
        assert all(r["error"] and "shutting down" in r["error"]["message"] for r in results), results
    events = json.loads(trace.read_text())                             # complete: it parses
    assert any(e.get("name", "").startswith("forward") for e in events)
    time.sleep(0.5)
    assert not any(alive(pid) for pid in ranks)
