"""Drive rank processes directly (no HTTP front) for engine-level end-to-end tests."""
from __future__ import annotations

import asyncio
import contextlib

from engine.args import parse_args
from engine.messages import SamplingParams
from server.rank_client import RankEngineClient
from tests.server_harness import pinned_dtype


@contextlib.asynccontextmanager
async def engine(flags: list[str]):
    client = RankEngineClient(parse_args(pinned_dtype(flags)))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def collect(client, rid: str, ids: list[int], params: SamplingParams):
    """All output tokens of one request and its last delta."""
    tokens, last = [], None
    async for delta in client.generate(rid, ids, params):
        tokens += delta.token_ids
        last = delta
    return tokens, last


async def run_batch(client, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], timeout=300):
    params = params if isinstance(params, list) else [params] * len(prompts)
    jobs = [collect(client, f"r{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
    return await asyncio.wait_for(asyncio.gather(*jobs), timeout)


# Every speculative algorithm on the embedded dense model (standalone drafts every step: its
# plain-step fallback under load off), for tests that run each.
ALGORITHMS = {
    "none": ["--speculative-algorithm", "none"],
    "eagle": ["--speculative-algorithm", "eagle"],
    "eagle3": ["--speculative-algorithm", "eagle3"],
    "standalone": ["--speculative-algorithm", "standalone", "--speculative-disable-by-batch-size", "0"],
    "ngram": ["--speculative-algorithm", "ngram"],
}
