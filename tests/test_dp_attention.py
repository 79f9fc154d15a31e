"""DP attention on the embedded MoE model, through real rank processes in a torch.distributed group
(gloo on 127.0.0.1): greedy output equals --dp-size 1 with speculation on (EAGLE with the MoE head,
n-gram) and off, overlap on and off, 2 and 3 ranks, under uneven load (one request alone: the other
ranks run idle steps; a long chunked prompt next to decodes; requests ending at different steps);
seeded sampling gives --dp-size 1's text; across two "hosts" (two launches); a rank killed mid-run;
and a prefill/decode pair with DP attention on both sides."""
from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import collect, engine, run_batch
from tests.pd_harness import generate, pd_pair, wait_idle
from tests.server_harness import MOE, REPO, Server, alive, free_port, metric, running_server

pytestmark = pytest.mark.slow
MOE_EAGLE = str(REPO / "models" / "tandem-moe-eagle")
ALGORITHMS = {
    "none": ["--speculative-algorithm", "none"],
    "eagle": ["--speculative-algorithm", "eagle", "--speculative-draft-model-path", MOE_EAGLE],
    "ngram": ["--speculative-algorithm", "ngram"],
}
BASE = ["--model-path", str(MOE), "--chunked-prefill-size", "32"]
DP = ["--enable-dp-attention"]


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MOE)
    ids = [tok.encode(p) for p in CODE_PROMPTS[:5]]
    return ids + [tok.encode("".join(CODE_PROMPTS))]              # a long prompt: several chunks


def budgets(count: int) -> list[SamplingParams]:
    """Requests that end at different steps."""
    return [SamplingParams(max_new_tokens=8 + 5 * i, temperature=0, ignore_eos=True) for i in range(count)]


async def outputs(flags: list[str], params: list[SamplingParams]) -> tuple[list[list[int]], list[int]]:
    """One request alone first (the other ranks idle), then all of them at once."""
    ids = prompts()
    async with engine(BASE + flags) as client:
        alone, _ = await asyncio.wait_for(collect(client, "alone", ids[0], params[0]), 120)
        together = await run_batch(client, ids, params, timeout=300)
        stats = await reported_after_the_run(client) if "--dp-size" in flags else client.rank_stats()
    return [alone] + [tokens for tokens, _ in together], stats


async def reported_after_the_run(client, seconds: float = 5.0) -> list:
    """The ranks' stats from reports made after the run: a rank reports every STATS_INTERVAL (0.5 s),
    and a report received after the last answer may have been made just before it, so wait (bounded)
    until every rank's report has been replaced twice."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    last = {link.rank: link.stats for link in client.links}
    replaced = dict.fromkeys(last, 0)
    while loop.time() < deadline and min(replaced.values()) < 2:
        await asyncio.sleep(0.05)
        for link in client.links:
            if link.stats is not last[link.rank]:
                last[link.rank] = link.stats
                replaced[link.rank] += 1
    return client.rank_stats()


@pytest.fixture(scope="module")
def reference():
    """One rank, no prefix cache: the DP runs (cache on, each rank its own) read the first prompt, sent
    alone first, from their cache when it comes again, and the long prompt's start (the first prompt's
    text) too, their match ending inside its first chunk."""
    return asyncio.run(outputs(ALGORITHMS["none"] + ["--disable-radix-cache"], budgets(6)))[0]


CONFIGS = {
    "none-dp2": [*ALGORITHMS["none"], "--dp-size", "2"],
    "none-dp2-no-overlap": [*ALGORITHMS["none"], "--dp-size", "2", "--disable-overlap-schedule"],
    "eagle-dp2": [*ALGORITHMS["eagle"], "--dp-size", "2"],
    "eagle-dp2-no-overlap": [*ALGORITHMS["eagle"], "--dp-size", "2", "--disable-overlap-schedule"],
    "ngram-dp2": [*ALGORITHMS["ngram"], "--dp-size", "2"],
    "none-dp3": [*ALGORITHMS["none"], "--dp-size", "3"],
    "eagle-dp3": [*ALGORITHMS["eagle"], "--dp-size", "3"],
}


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_dp_attention_greedy_equals_one_rank(config, reference):
    got, stats = await outputs(DP + CONFIGS[config], budgets(6))
    assert got == reference
    assert sum(s.value("tandem_dp_idle_steps") for s in stats) > 0     # some rank had nothing while another worked


@pytest.mark.parametrize("algorithm", ["none", "eagle"])
async def test_dp_attention_seeded_sampling_equals_one_rank(algorithm):
    seeded = [SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5 + i, ignore_eos=True)
              for i in range(6)]
    one, _ = await outputs(ALGORITHMS[algorithm], seeded)
    two, _ = await outputs(DP + ALGORITHMS[algorithm] + ["--dp-size", "2"], seeded)
    assert two == one


async def http_outputs(url: str, ids: list[list[int]]) -> list[list[int]]:
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*[generate(session, url, p, 12) for p in ids])
    return [a["output_ids"] for a in answers]


async def test_dp_attention_across_two_hosts_equals_one_process(tmp_path):
    ids = prompts()
    with running_server(BASE + ALGORITHMS["none"], tmp_path / "one.log") as one:
        expected = await http_outputs(one.url, ids)
    addr = f"127.0.0.1:{free_port(span=2)}"              # node 0 takes the other hosts' ranks on port + 1
    multi = [*BASE, *DP, *ALGORITHMS["none"], "--dp-size", "2", "--nnodes", "2", "--dist-init-addr", addr,
             "--rank-secret", "shared-by-both-hosts"]
    node1 = Server([*multi, "--node-rank", "1"], tmp_path / "node1.log")
    try:
        with running_server([*multi, "--node-rank", "0"], tmp_path / "node0.log") as node0:
            assert await http_outputs(node0.url, ids) == expected
    finally:
        node1.stop()


async def test_a_killed_rank_takes_its_group_down_and_the_group_comes_back(tmp_path):
    flags = BASE + DP + ALGORITHMS["none"] + ["--dp-size", "2"]
    with running_server(flags, tmp_path / "kill.log") as srv:
        ranks = srv.rank_pids()
        async with aiohttp.ClientSession() as session:
            jobs = [asyncio.create_task(long_request(session, srv.url)) for _ in range(4)]
            await asyncio.sleep(2.0)
            os.kill(ranks[1], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*jobs), 30)        # an answer or an error each
            assert all(status in (200, 500, 503) for status in results)
            assert any(status != 200 for status in results)
            await asyncio.to_thread(srv.wait_ranks, 2)
            assert not any(alive(pid) for pid in ranks)                     # the whole old group is gone
            ids = prompts()[:2]
            assert len(await http_outputs(srv.url, ids)) == 2
    assert "exit code 4" in srv.log.read_text() or "killed by SIGKILL" in srv.log.read_text()


async def long_request(session, url: str) -> int:
    body = {"input_ids": prompts()[1], "sampling_params": {"max_new_tokens": 1500, "temperature": 0,
                                                           "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as resp:
        await resp.read()
        return resp.status


async def test_pd_with_dp_attention_on_both_sides_equals_unified(tmp_path, reference):
    ids = prompts()
    common = [*BASE, *DP, *ALGORITHMS["none"], "--dp-size", "2"]
    with pd_pair([], [], tmp_path, common=common) as pair:
        async with aiohttp.ClientSession() as session:
            answers = [await generate(session, pair.url, p, 8 + 5 * i) for i, p in enumerate(ids)]
            decode_metrics, prefill_metrics = await wait_idle(session, pair.url, pair.prefill.url)
    assert [a["output_ids"] for a in answers] == reference[1:]
    assert metric(decode_metrics, 'tandem_pd_rooms_finished_total{state="done"}') == len(ids)
