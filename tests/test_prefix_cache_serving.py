"""The prefix cache through a real server (run.py on the embedded model, the openai client and aiohttp):
a prompt sent again reads its start from the cache and answers the same; usage and meta_info say how
many tokens were cached; /flush_cache empties the cache when idle and is refused while a request runs;
the pool's pages add up in /metrics."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.server_harness import metric, running_server

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers in place and return it.\"\"\"\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--max-running-requests", "4"], tmp_path_factory.mktemp("srv") / "server.log") as srv:
        yield srv


async def complete(client: AsyncOpenAI, prompt: str):
    return await client.completions.create(model="tandem-dense", prompt=prompt, max_tokens=12, temperature=0)


async def settled_metrics(http: aiohttp.ClientSession, url: str, seconds: float = 10.0) -> str:
    """/metrics once the rank reports no request running and the same free and cached slots twice (a rank
    reports every half second: a scrape right after a request may show the report before it)."""
    last, seen = None, []
    for _ in range(int(seconds / 0.6)):
        async with http.get(url + "/metrics") as response:
            text = await response.text()
        pages = (metric(text, "tandem_kv_slots_free"), metric(text, "tandem_prefix_cache_tokens"))
        seen.append(pages)
        if pages == last and metric(text, "tandem_num_running_reqs") == 0:
            return text
        last = pages
        await asyncio.sleep(0.6)
    raise AssertionError(f"the rank's statistics did not settle: {seen}")


async def test_a_prompt_sent_again_is_read_from_the_cache_until_it_is_flushed(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/flush_cache") as response:
            assert response.status == 200
        first = await complete(client, PROMPT)
        again = await complete(client, PROMPT)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert again.choices[0].text == first.choices[0].text
        async with http.post(server.url + "/generate", json={"text": PROMPT + "    if",
                                                             "sampling_params": {"max_new_tokens": 4}}) as response:
            meta = (await response.json())["meta_info"]
        # the prompt's last position was cached followed by the answer, here by " if": the default EAGLE head's
        # K/V there depends on the token after it (engine/radix_cache.py: lookahead), so that one is computed
        assert meta["cached_tokens"] >= first.usage.prompt_tokens - 2

        stream = await client.completions.create(model="tandem-dense", prompt="import os\n", max_tokens=1000,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:                       # running now: its first token is out
            async with http.post(server.url + "/flush_cache") as response:
                body = await response.json()
                assert response.status == 400 and "requests are running" in body["error"]["message"]
            break
        await stream.close()                         # the client goes away: the request is aborted
        text = await settled_metrics(http, server.url)
        cached = metric(text, "tandem_prefix_cache_tokens")
        assert cached > 0 and metric(text, "tandem_prefix_cache_idle_tokens") == cached
        assert metric(text, "tandem_kv_slots_used") + metric(text, "tandem_kv_slots_free") + cached == \
            metric(text, "tandem_kv_slots_total")
        assert metric(text, "tandem_prefix_cache_hit_tokens_total") >= first.usage.prompt_tokens - 1
        async with http.post(server.url + "/flush_cache") as response:
            assert response.status == 200 and (await response.text()).startswith("Cache flushed")
        fresh = await complete(client, PROMPT)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0 and fresh.choices[0].text == first.choices[0].text
