"""Start a prefill node and a decode node (real run.py processes on 127.0.0.1) for PD tests."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.server_harness import Server, free_port, metric


@dataclass
class PdPair:
    prefill: Server
    decode: Server
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.decode.url


def start_prefill(port: int, flags: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    return Server(["--role", "prefill", "--disaggregation-bootstrap-port", str(port), *flags], log, env)


def start_pair(prefill_flags: list[str], decode_flags: list[str], log_dir: Path, common: list[str] = (),
               prefill_env: dict[str, str] | None = None) -> PdPair:
    port = free_port()
    prefill = start_prefill(port, [*common, *prefill_flags], log_dir / "prefill.log", prefill_env)
    # both start at once: the decode node keeps trying to reach the prefill node until it is up
    decode = Server(["--role", "decode", "--prefill-addr", f"127.0.0.1:{port}", *common, *decode_flags],
                    log_dir / "decode.log")
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return PdPair(prefill, decode, port)


@contextlib.contextmanager
def pd_pair(prefill_flags: list[str], decode_flags: list[str], log_dir: Path, common: list[str] = (),
            prefill_env: dict[str, str] | None = None):
    pair = start_pair(prefill_flags, decode_flags, log_dir, common, prefill_env)
    try:
        yield pair
    finally:
        pair.decode.stop()
        pair.prefill.stop()


async def metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def wait_idle(session: aiohttp.ClientSession, *urls: str, timeout: float = 30.0) -> list[str]:
    """/metrics of each node once it reports no KV in use and nothing running or waiting."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        texts = [await metrics(session, url) for url in urls]
        if all(metric(t, "tandem_kv_slots_used") == 0 and metric(t, "tandem_num_running_reqs") == 0
               and metric(t, "tandem_num_waiting_reqs") == 0 and metric(t, "tandem_kv_slots_total") > 0
               and not open_rooms(t) for t in texts):
            return texts
        assert asyncio.get_running_loop().time() < deadline, "KV still in use:\n" + "\n".join(
            line for t in texts for line in t.splitlines() if line.startswith("tandem_kv") or "pd_rooms" in line)
        await asyncio.sleep(0.3)


def open_rooms(text: str) -> float:
    """Transfers still in flight, by the node's gauges."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tandem_pd_rooms{"))


async def generate(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int, **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True,
                                                   **params}}
    async with session.post(url + "/generate", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer
