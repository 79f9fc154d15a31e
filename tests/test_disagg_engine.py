"""Prefill/decode disaggregation at the engine level, in one process: a prefill engine exports each
prompt chunk's KV (target and draft) and then the first token with the draft's state; a decode
engine reserves room, writes the arriving KV and continues. Outputs equal the unified engine's, for
every algorithm, with prompts longer than --chunked-prefill-size, greedy and seeded, the prefill
engine reading the prompt's start from its prefix cache (and sending it all the same)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.disagg import PrefillExporter, RemoteKv, prefill_params
from engine.messages import KvLayer, PrefillDone, PrefillReserved, SamplingParams
from engine.rank import build_core
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.server_harness import DENSE

NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
BASE = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "4",
        "--chunked-prefill-size", "16"]


class FakeChannel:
    """A rank's channel to its front, recorded."""

    def __init__(self):
        self.sent: list = []
        self.writer = SimpleNamespace(drain=self.drain)

    def send_nowait(self, msg) -> None:
        self.sent.append(msg)

    async def drain(self) -> None:
        pass


@pytest.fixture(scope="module")
def prompt():
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(DENSE).encode(CODE_PROMPTS[1])
    assert len(ids) > 16                                   # several chunks
    return ids


async def run(core, until, on_news=None, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if until():
            return
        for req in await core.step():
            if on_news:
                on_news(req)
    raise AssertionError("the engine did not get there")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
async def test_prefill_on_one_engine_decode_on_another(algorithm, params, prompt):
    flags = BASE + ALGORITHMS[algorithm]
    devices = [CpuDevice() for _ in range(3)]
    try:
        unified = build_core(parse_args(flags), devices[0], eos_ids=frozenset())
        assert unified.scheduler.add("r", prompt, params) is None
        reference = unified.scheduler.requests["r"]
        await run(unified, lambda: not unified.busy)

        prefill = build_core(parse_args(flags), devices[1], eos_ids=frozenset())
        to_front = FakeChannel()
        exporter = PrefillExporter(prefill, to_front)
        sender = asyncio.create_task(exporter.run())
        decode = build_core(parse_args(flags), devices[2], eos_ids=frozenset())
        remote = RemoteKv(decode, FakeChannel())

        # the prefill node has seen the prompt's start: it computes only the rest, and sends it all
        assert prefill.scheduler.add("seen", prompt[:-5], GREEDY) is None
        await run(prefill, lambda: not prefill.busy)
        assert decode.scheduler.add("r", prompt, params, remote=True) is None
        remote.reserve()
        assert isinstance(remote.channel.sent[-1], PrefillReserved)
        assert prefill.scheduler.add("r", prompt, prefill_params(params)) is None
        assert prefill.scheduler.requests["r"].cached_tokens == 0       # not admitted yet
        hits = prefill.scheduler.pool.cache.stats.hit_tokens
        exporter.add("r")
        done = lambda: any(isinstance(m, PrefillDone) for m in to_front.sent)  # noqa: E731
        await run(prefill, lambda: not prefill.busy, on_news=exporter.finished)    # as the rank hands it news
        for _ in range(200):
            if done():
                break
            await asyncio.sleep(0.01)
        sender.cancel()
        assert prefill.scheduler.pool.used_slots == 0           # the prefill side holds nothing (its cache aside)
        assert len(prompt) - 5 <= prefill.scheduler.pool.cache.stats.hit_tokens - hits < len(prompt)
        layers = [m for m in to_front.sent if isinstance(m, KvLayer)]
        assert sum(m.count for m in layers if m.layer == 0 and m.kind == "target") == len(prompt)
        assert any(m.kind == "draft" for m in layers) == (algorithm in ("eagle", "eagle3", "standalone"))
        for msg in to_front.sent:
            (remote.write if isinstance(msg, KvLayer) else remote.activate)(msg)
        moved = decode.scheduler.requests["r"]
        await run(decode, lambda: not decode.busy)
        assert moved.output_ids == reference.output_ids
        assert decode.scheduler.pool.used_slots == 0
    finally:
        for device in devices:
            device.close()
