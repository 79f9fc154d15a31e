"""Prefill/decode failures with real processes and sockets on 127.0.0.1; each ends with no KV in use
on the nodes still up, and nothing hangs: a prefill node killed mid-transfer, a decode node killed
mid-transfer, a client that leaves during the prefill, garbage / oversize / wrong-version / wrong-model
/ wrong-secret peers on the bootstrap port, and a prefill node that stops answering.

The prefill node runs slowly here (the fault hook's `where=delay` adds time to each of its steps), so
that a transfer is still going when the fault strikes."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from engine.faults import ENV
from engine.framing import HEADER, PROTOCOL_VERSION, Hello, Refusal, encode_frame
from engine.handshake import handshake
from server.pd.fingerprint import model_fingerprint
from server.pd.messages import ToDecode
from server.pd.transport import pd_connection
from tests.e2e_prompts import CODE_PROMPTS
from tests.pd_harness import metrics, pd_pair, start_prefill, wait_idle
from tests.server_harness import DENSE, metric

pytestmark = pytest.mark.slow
SLOW_PREFILL = {ENV: "step=1,times=100000000,where=delay,seconds=0.1"}
COMMON = ["--speculative-algorithm", "eagle", "--chunked-prefill-size", "16"]
LONG_PROMPT = "".join(CODE_PROMPTS) * 2                     # dozens of chunks of 16


async def complete(session, url: str, prompt: str = LONG_PROMPT, max_tokens: int = 16, stream: bool = False):
    """(status, text of the answer or of its error)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            text = await resp.text()
            return resp.status, text
    except aiohttp.ClientError as exc:
        return None, repr(exc)


def failed_clearly(status, text) -> bool:
    """An error status with an OpenAI-style body that says what failed."""
    if status is None or status < 400:
        return False
    error = json.loads(text)["error"]
    return bool(error["message"]) and error["code"] in ("engine_error", "engine_dead")


async def wait_for(check, timeout: float, every: float = 0.05) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(every)


async def transferring(session, url: str) -> bool:
    return metric(await metrics(session, url), "tandem_pd_transferred_bytes_total") > 0


async def test_a_prefill_node_killed_mid_transfer_fails_its_rooms_and_the_decode_node_recovers(tmp_path):
    with pd_pair([], ["--disaggregation-timeout", "30"], tmp_path, COMMON, SLOW_PREFILL) as pair:
        async with aiohttp.ClientSession() as session:
            jobs = [asyncio.create_task(complete(session, pair.url)) for _ in range(4)]
            await wait_for(lambda: transferring(session, pair.url), 30)
            os.killpg(pair.prefill.process.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*jobs), 30)
            assert all(failed_clearly(*r) for r in results), results
            [decode_metrics] = await wait_idle(session, pair.url)
            assert metric(decode_metrics, 'tandem_pd_rooms_finished_total{state="failed"}') == 4
            pair.prefill.process.wait(10)
            restarted = start_prefill(pair.bootstrap_port, COMMON, tmp_path / "prefill2.log").wait_healthy()
            try:
                await wait_for(lambda: healthy(session, pair.url), 30, every=0.3)
                status, text = await complete(session, pair.url, CODE_PROMPTS[0])
                assert status == 200, text
            finally:
                restarted.stop()


async def healthy(session, url: str) -> bool:
    async with session.get(url + "/health") as resp:
        return resp.status == 200


async def test_a_decode_node_killed_mid_transfer_frees_everything_on_the_prefill_node(tmp_path):
    with pd_pair([], [], tmp_path, COMMON, SLOW_PREFILL) as pair:
        async with aiohttp.ClientSession() as session:
            jobs = [asyncio.create_task(complete(session, pair.url)) for _ in range(4)]
            await wait_for(lambda: transferring(session, pair.prefill.url), 30)
            os.killpg(pair.decode.process.pid, signal.SIGKILL)
            await asyncio.gather(*jobs)
            [prefill_metrics] = await wait_idle(session, pair.prefill.url, timeout=20)
            assert metric(prefill_metrics, 'tandem_pd_rooms_finished_total{state="failed"}') == 4
            assert sum(metric(prefill_metrics, f'tandem_pd_rooms{{state="{s}"}}')
                       for s in ("bootstrapping", "waiting", "transferring")) == 0
            assert await healthy(session, pair.prefill.url)


async def test_a_client_leaving_during_the_prefill_aborts_it_on_both_nodes(tmp_path):
    with pd_pair([], [], tmp_path, COMMON, SLOW_PREFILL) as pair:
        async with aiohttp.ClientSession() as session:
            job = asyncio.create_task(complete(session, pair.url, max_tokens=64, stream=True))
            await wait_for(lambda: transferring(session, pair.prefill.url), 30)
            job.cancel()                                          # the client goes away mid-prefill
            await asyncio.gather(job, return_exceptions=True)
            # well before the slowed prefill of this prompt could end (dozens of chunks x 100 ms)
            decode_metrics, prefill_metrics = await wait_idle(session, pair.url, pair.prefill.url, timeout=2.0)
            for text in (decode_metrics, prefill_metrics):
                assert metric(text, 'tandem_pd_rooms_finished_total{state="failed"}') == 1
                assert metric(text, 'tandem_pd_rooms_finished_total{state="done"}') == 0


async def raw_peer(port: int, payload: bytes) -> bytes:
    """Send bytes to the bootstrap port; what comes back before the node closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 15)          # EOF: the node closed it
    writer.close()
    return answer


async def shake(port: int, fingerprint: str, secret: bytes | None) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = pd_connection(reader, writer, ToDecode)
    try:
        await handshake(conn, "decode", fingerprint, secret, 10)
    finally:
        conn.close("test done")


async def test_bad_peers_on_the_bootstrap_port_are_refused_and_harm_nothing(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    flags = ["--speculative-algorithm", "none", "--pd-secret", f"@{secret}"]
    with pd_pair([], [], tmp_path, flags) as pair:
        port, good = pair.bootstrap_port, model_fingerprint(str(DENSE), "float32", 1, "none", 0, None)
        await raw_peer(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)                # read as version "GE"
        await raw_peer(port, HEADER.pack(PROTOCOL_VERSION, 12) + b"\xc1" * 12)    # a frame msgpack cannot read
        await raw_peer(port, HEADER.pack(PROTOCOL_VERSION, 1 << 31) + b"x" * 64)   # over the size limit
        hello = Hello(role="decode", fingerprint=good, nonce=os.urandom(32))
        await raw_peer(port, encode_frame(hello, version=99))
        for fingerprint, key, reason in ((good, b"wrong", "wrong secret"), (good, None, "no secret"),
                                         ("0" * 16, b"correct horse battery staple", "fingerprint differs")):
            with pytest.raises(Refusal, match=reason):
                await shake(port, fingerprint, key)
        reasons = ("undecodable frame", "exceeds the limit", "protocol versions differ", "wrong secret",
                   "no secret", "fingerprint differs")
        for _ in range(50):                  # the node logs a refusal just after it sends it
            log = pair.prefill.log.read_text()
            if all(reason in log for reason in reasons):
                break
            await asyncio.sleep(0.1)
        for reason in reasons:
            assert reason in log, reason
        async with aiohttp.ClientSession() as session:
            status, text = await complete(session, pair.url, CODE_PROMPTS[0])
            assert status == 200, text                           # the real decode node was never disturbed


async def test_a_prefill_node_that_stops_answering_times_out(tmp_path):
    with pd_pair([], ["--disaggregation-timeout", "3"], tmp_path, ["--speculative-algorithm", "none"]) as pair:
        os.killpg(pair.prefill.process.pid, signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession() as session:
                status, text = await asyncio.wait_for(complete(session, pair.url, CODE_PROMPTS[0]), 20)
                assert failed_clearly(status, text) and "timed out" in text, text
                await wait_idle(session, pair.url)
        finally:
            os.killpg(pair.prefill.process.pid, signal.SIGCONT)
