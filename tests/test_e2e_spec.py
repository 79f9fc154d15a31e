"""Speculative decoding end to end on the embedded models: lossless for every algorithm
(overlap on and off, dense and MoE), exact max_tokens, stops inside an accepted run, and
no KV left behind after aborts."""
from __future__ import annotations

import asyncio

import pytest

from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import collect, engine, run_batch
from tests.server_harness import DENSE, MOE, REPO

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
SPEC_TOKENS = 5              # the most tokens one step emits: EAGLE's default 4 drafts + 1 (standalone: 3 + 1)
# what the tests read from a rank's report (RankStats.value); verify steps: the accept histogram's count
RUNNING, WAITING, KV_USED = "tandem_num_running_reqs", "tandem_num_waiting_reqs", "tandem_kv_slots_used"
VERIFY_STEPS = "tandem_spec_accept_length_per_step"
SPEC = {
    "eagle": ["--speculative-algorithm", "eagle",
              "--speculative-draft-model-path", str(REPO / "models/tandem-dense-eagle")],
    "eagle3": ["--speculative-algorithm", "eagle3", "--speculative-draft-model-path",
               str(REPO / "models/tandem-dense-eagle3")],
    # the embedded 2-layer draft, drafting at every batch size (its default turns off from 2)
    "standalone": ["--speculative-algorithm", "standalone", "--speculative-disable-by-batch-size", "0"],
    "ngram": ["--speculative-algorithm", "ngram"],
}
MOE_SPEC = {
    "eagle": ["--speculative-algorithm", "eagle",
              "--speculative-draft-model-path", str(REPO / "models/tandem-moe-eagle")],
    "ngram": ["--speculative-algorithm", "ngram"],
}


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(p) for p in CODE_PROMPTS[:10]]


@pytest.fixture(scope="module")
def reference(prompts):
    async def run():
        async with engine(["--model-path", str(DENSE), "--speculative-algorithm", "none"]) as client:
            return [t for t, _ in await run_batch(client, prompts, GREEDY)]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def moe_reference(prompts):
    async def run():
        async with engine(["--model-path", str(MOE), "--speculative-algorithm", "none"]) as client:
            return [t for t, _ in await run_batch(client, prompts, GREEDY)]
    return asyncio.run(run())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("algorithm", list(SPEC))
async def test_dense_speculation_is_lossless(algorithm, overlap, prompts, reference):
    flags = ["--model-path", str(DENSE), *SPEC[algorithm]] + ([] if overlap else ["--disable-overlap-schedule"])
    async with engine(flags) as client:
        results = await run_batch(client, prompts, GREEDY)
    assert [t for t, _ in results] == reference
    verify_steps = sum(d.spec_verify_ct for _, d in results)
    assert 0 < verify_steps < sum(len(t) for t in reference)      # speculation ran, and accepted something


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("algorithm", list(MOE_SPEC))
async def test_moe_speculation_is_lossless(algorithm, overlap, prompts, moe_reference):
    if algorithm == "eagle" and not (REPO / "models/tandem-moe-eagle/config.json").exists():
        pytest.fail("models/tandem-moe-eagle is missing")
    flags = ["--model-path", str(MOE), *MOE_SPEC[algorithm]] + ([] if overlap else ["--disable-overlap-schedule"])
    async with engine(flags) as client:
        results = await run_batch(client, prompts, GREEDY)
    assert [t for t, _ in results] == moe_reference


@pytest.mark.parametrize("algorithm", list(SPEC))
async def test_speculation_switches_off_under_load_and_stays_lossless(algorithm, prompts, reference):
    """--speculative-disable-by-batch-size 5 with 10 requests of 4..40 tokens: plain steps while
    5+ decode, drafting again as they finish; outputs stay greedy's and the metrics say so."""
    params = [SamplingParams(max_new_tokens=4 + 4 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    flags = ["--model-path", str(DENSE), *SPEC[algorithm], "--speculative-disable-by-batch-size", "5"]
    async with engine(flags) as client:
        results = await run_batch(client, prompts, params)
        for _ in range(50):
            stats = client.rank_stats()
            if stats and stats[0].value(RUNNING) == 0 and stats[0].value(VERIFY_STEPS) > 0:     # after the run
                break
            await asyncio.sleep(0.2)
    assert [t for t, _ in results] == [ref[:p.max_new_tokens] for ref, p in zip(reference, params)]
    assert stats[0].value("tandem_spec_off_steps") > 0 and stats[0].value(VERIFY_STEPS) > 0


async def test_max_tokens_exact_and_stops_cut_inside_accepted_runs(prompts, reference):
    async with engine(["--model-path", str(DENSE), *SPEC["eagle"]]) as client:
        for n in (1, 2, 3, 5, 7, 11):
            tokens, last = await collect(client, f"len{n}", prompts[0], SamplingParams(max_new_tokens=n, temperature=0,
                                                                                        ignore_eos=True))
            assert len(tokens) == last.completion_tokens == n and last.finish_reason == "length"
            assert tokens == reference[0][:n]
        for i, ref in enumerate(reference):
            stop = ref[5]                                 # a token in the middle of the greedy output
            cut = ref.index(stop) + 1
            tokens, last = await collect(client, f"stop{i}", prompts[i], SamplingParams(
                max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop,)))
            assert tokens == ref[:cut] and last.finish_reason == "stop" and last.matched_stop == stop


@pytest.mark.parametrize("algorithm", ["eagle", "standalone"])
async def test_aborts_mid_speculation_free_every_slot(prompts, algorithm):
    """EAGLE drafts throughout; standalone (off from 2 decoding requests, its default) decodes plain
    under this load, its decodes in batches with prompt chunks."""
    flags = SPEC["eagle"] if algorithm == "eagle" else ["--speculative-algorithm", "standalone"]
    progress = VERIFY_STEPS if algorithm == "eagle" else "tandem_spec_off_steps"
    async with engine(["--model-path", str(DENSE), *flags]) as client:
        long = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)
        streams = [client.generate(f"a{i}", ids, long) for i, ids in enumerate(prompts)]
        for stream in streams:
            await stream.__anext__()
        for stream in streams[::2]:
            await stream.aclose()                          # abort half of them mid-run
        await run_batch(client, prompts[:4], SamplingParams(max_new_tokens=8, temperature=0.8, seed=3))
        for stream in streams[1::2]:
            await stream.aclose()
        for _ in range(100):
            stats = client.rank_stats()       # progress > 0: a report from after decoding began
            if stats and stats[0].value(progress) > 0 and stats[0].value(KV_USED) == 0 and stats[0].value(RUNNING) == 0:
                break
            await asyncio.sleep(0.2)
        assert stats[0].value(progress) > 0
        assert stats[0].value(KV_USED) == 0 and stats[0].value(RUNNING) == 0 and stats[0].value(WAITING) == 0
        # freed while they would still be running: any one of them alone needs 1500 / (k+1) steps
        assert stats[0].value("tandem_steps_total") < 1500 // SPEC_TOKENS


async def test_two_data_parallel_ranks_and_stream_interval(prompts, reference):
    flags = ["--model-path", str(DENSE), *SPEC["eagle"], "--dp-size", "2", "--stream-interval", "8"]
    async with engine(flags) as client:
        assert len(client.rank_stats()) in (0, 1, 2) and len(client.links) == 2
        counts = []

        async def count_deltas(i, ids):
            tokens, deltas = [], 0
            async for delta in client.generate(f"dp{i}", ids, GREEDY):
                tokens += delta.token_ids
                deltas += 1
                assert len(delta.token_ids) >= 8 or delta.finish_reason
            counts.append(deltas)
            return tokens
        outs = await asyncio.wait_for(asyncio.gather(*[count_deltas(i, p) for i, p in enumerate(prompts)]), 300)
    assert outs == reference
    assert max(counts) <= 40 // 8 + 1


async def test_trace_file_shows_overlapped_spans(prompts, tmp_path):
    import json
    trace = tmp_path / "trace.json"
    async with engine(["--model-path", str(DENSE), *SPEC["eagle"], "--trace-file", str(trace)]) as client:
        await run_batch(client, prompts[:4], GREEDY)
    events = json.loads(trace.read_text())
    spans = [e for e in events if e.get("ph") == "X"]
    names = {e["name"].split()[0] for e in spans}
    assert {"schedule", "launch", "forward", "process", "draft", "verify", "extend"} <= names
    tracks = {e["tid"] for e in spans}
    assert tracks == {1, 2, 3, 4}
    # Overlap: some CPU scheduling span lies inside a device span of the previous batch.
    device = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith("forward")]
    schedule = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith("schedule")]
    assert any(d0 <= s0 and s1 <= d1 for s0, s1 in schedule for d0, d1 in device)
