"""The radix prefix cache on the embedded model, in-process: greedy outputs of requests that read
cached prefixes are plain greedy decoding's without any cache, for every speculative algorithm,
overlap on and off, one step and four a launch, pages of 1 and 4 tokens, CPU graphs.

The second wave's prompts meet the cache in each way that matters: the whole prompt sent again
(all but its last page read), a prompt that shares a prefix ending inside a page, one whose
uncached rest spans several prefill chunks (and whose match ends inside what was a chunk of the
prompt that left it), and a chat's next turn (an earlier prompt, its answer, a new question).

Seeded requests asked after one shared system prompt answer as they would without a cache (their tokens
depend on their drafts, so a cached page must hold the draft's K/V as they would compute it). A pool of a
few prompts' worth under many prompts that share parts evicts, answers as without a cache, and keeps
every page in one place after every step. A trace lists each admission with the tokens it read from the
cache. In float32 with an unquantized head a seeded answer does not depend on its prefill's chunking,
which is what makes answers read from the cache the same as those computed alone (bench/chunking.py).
"""
from __future__ import annotations

import asyncio
import json
import random
from functools import lru_cache

import pytest

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.messages import SamplingParams
from engine.rank import build_core
from engine.trace import Tracer
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.pool_checks import check_pool
from tests.server_harness import DENSE

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
BASE = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "4",
        "--chunked-prefill-size", "16", "--dtype", "float32"]


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DENSE)


@pytest.fixture(scope="module")
def waves():
    tok = tokenizer()
    first = [tok.encode(CODE_PROMPTS[i]) for i in (1, 3, 5)]
    a, b, c = first
    second = [
        list(a),                                      # the whole prompt again
        b[:len(b) // 2 + 1] + tok.encode(" return x"),  # a prefix that ends inside a page
        c[:5] + c[5:][::-1] + c[:30],                 # a short match, a rest of several chunks
        c[:21] + tok.encode(" # note\n") + c[21:40],  # the match ends inside the first chunk of c
    ]
    return first, second


def run_waves(flags: list[str], waves) -> tuple[list[list[int]], list[int]]:
    """Outputs of the first wave then the second (with the first wave's answers' next turn), and each
    second-wave request's cached tokens."""
    requests = serve_waves(build_core(parse_args(BASE + flags), CpuDevice(), eos_ids=frozenset()), waves)
    again = requests[len(waves[0]):]
    return [r.output_ids for r in requests], [r.cached_tokens for r in again]


def serve_waves(core, waves) -> list:
    """The first wave's requests, then the second's (with the first wave's answers' next turn)."""
    first, second = waves

    async def wave(prompts: list[list[int]], tag: str):
        requests = []
        for i, prompt in enumerate(prompts):
            assert core.scheduler.add(f"{tag}{i}", prompt, GREEDY) is None
            requests.append(core.scheduler.requests[f"{tag}{i}"])
        for _ in range(5000):
            if not core.busy:
                return requests
            await core.step()
        raise AssertionError("the engine did not finish")

    async def both():
        done = await wave(first, "a")
        turn = first[0] + done[0].output_ids + first[1][:12]               # a chat's next turn
        return done, await wave(second + [turn], "b")
    done, again = asyncio.run(both())
    core.runner.device.synchronize()
    return done + again


@pytest.fixture(scope="module")
def reference(waves):
    outputs, cached = run_waves(ALGORITHMS["none"] + ["--disable-radix-cache"], waves)
    assert not any(cached)
    return outputs


CASES = {
    "none": ALGORITHMS["none"],
    "none-no-overlap-1-step": ALGORITHMS["none"] + ["--disable-overlap-schedule", "--num-scheduler-steps", "1"],
    "eagle": ALGORITHMS["eagle"] + ["--page-size", "4"],
    "eagle-no-overlap-1-step": ALGORITHMS["eagle"] + ["--disable-overlap-schedule", "--num-scheduler-steps", "1"],
    "eagle-graphs": ALGORITHMS["eagle"] + ["--enable-cpu-graph", "--num-scheduler-steps", "4"],
    "eagle3": ALGORITHMS["eagle3"] + ["--num-scheduler-steps", "4"],
    "standalone": ALGORITHMS["standalone"] + ["--page-size", "4", "--num-scheduler-steps", "4"],
    "ngram": ALGORITHMS["ngram"] + ["--disable-overlap-schedule"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_with_the_cache_are_plain_greedy_decodings(case, waves, reference):
    outputs, cached = run_waves(CASES[case], waves)
    page = 4 if "--page-size" in CASES[case] else 1
    first, second = waves
    assert outputs == reference
    whole = len(first[0]) - 1
    assert cached[0] == whole - whole % page                        # all but the last token, in pages
    assert all(cached), cached                                      # every prompt of the wave read the cache
    assert cached[3] < 40 and cached[-1] >= len(first[0])           # inside c's first chunks; past a's answer


# ---- seeded requests: drafts must read what they would alone ------------------------------------

def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=1 + i % 3, ignore_eos=True)


@pytest.fixture(scope="module")
def questions():
    """Questions after one shared system prompt: each leaves it with another token than the one before."""
    tok = tokenizer()
    system = tok.encode(CODE_PROMPTS[5]) + tok.encode(CODE_PROMPTS[2])
    rng = random.Random(0)
    return [system + tok.encode(CODE_PROMPTS[rng.randrange(10)])[:rng.randrange(3, 20)] for _ in range(8)]


def one_at_a_time(flags: list[str], prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt served alone after the one before it ended (so it reads what they left)."""
    core = build_core(parse_args(BASE + flags), CpuDevice(), eos_ids=frozenset())

    async def serve():
        requests = []
        for i, prompt in enumerate(prompts):
            assert core.scheduler.add(f"q{i}", prompt, seeded(i)) is None
            requests.append(core.scheduler.requests[f"q{i}"])
            while core.busy:
                await core.step()
        return requests
    requests = asyncio.run(serve())
    return [r.output_ids for r in requests], [r.cached_tokens for r in requests]


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "standalone"])
def test_seeded_outputs_with_the_cache_are_those_without(algorithm, questions):
    """A seeded request's tokens depend on its drafts: a cached page must hold the draft's K/V as the request
    would have computed it, which for an EAGLE head (it reads token t+1 at position t) depends on the token
    after the page too (engine/radix_cache.py: lookahead)."""
    outputs, cached = one_at_a_time(ALGORITHMS[algorithm], questions)
    alone, _ = one_at_a_time(ALGORITHMS[algorithm] + ["--disable-radix-cache"], questions)
    assert all(cached[1:]), cached
    assert outputs == alone


def test_an_ngram_draft_looks_up_the_cached_part_of_its_prompt(questions):
    """N-gram drafts come from a per-row history of the request's tokens, and a row holds what its last
    request left there: a prompt that reads its start from the cache must bring those tokens to its row.
    Between two questions an unrelated prompt as long as the system prompt runs on the row, so a
    question whose history kept it would draft from the wrong tokens (and a seeded answer depends on
    its drafts)."""
    tok = tokenizer()
    others = [0, 1, 3, 4, 6, 7, 8, 9]                # not the system prompt's pieces (5, 2)
    unrelated = [sum((tok.encode(CODE_PROMPTS[i]) for i in others[j:] + others[:j]), []) for j in (1, 4, 6)]
    assert all(len(u) > len(questions[0]) for u in unrelated)
    prompts = [p for pair in zip(questions[:3], unrelated) for p in pair]
    outputs, cached = one_at_a_time(ALGORITHMS["ngram"], prompts)
    alone, _ = one_at_a_time(ALGORITHMS["ngram"] + ["--disable-radix-cache"], prompts)
    assert all(cached[2::2]), cached
    assert outputs == alone


# ---- a pool of a few prompts' worth: evictions on the real engine --------------------------------

SMALL_POOL = ["--max-total-tokens", "160"]
ARRIVAL_GAP = 3             # steps between arrivals: earlier requests end and leave their pages meanwhile


@pytest.fixture(scope="module")
def many_prefixes():
    """Prompts over three system prompts with distinct tails, some sent again whole and some continued (a
    chat's next turn), together far more distinct tokens than the pool holds."""
    rng, pieces = random.Random(3), [tokenizer().encode(text) for text in CODE_PROMPTS]
    systems = [pieces[5], pieces[2] + pieces[1], pieces[9] + pieces[8] + pieces[3]]
    prompts = []
    for _ in range(30):
        piece = rng.choice(pieces)
        start = rng.randrange(len(piece))
        tail, share = piece[start:start + rng.randrange(2, 12)], rng.random()
        earlier = rng.choice(prompts) if prompts else []
        if earlier and share < 0.25:
            prompts.append(list(earlier))
        elif earlier and share < 0.5 and len(earlier) < 90:
            prompts.append(earlier + tail)
        else:
            prompts.append(rng.choice(systems) + tail)
    return prompts


def serve_arriving(flags: list[str], prompts: list[list[int]], check=None):
    """The prompts arriving every ARRIVAL_GAP steps (greedy); `check(scheduler)` after every step.
    Returns the core and the requests."""
    core = build_core(parse_args(BASE + flags), CpuDevice(), eos_ids=frozenset())
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)

    async def serve():
        requests = []
        for step in range(5000):
            if len(requests) < len(prompts) and (step % ARRIVAL_GAP == 0 or not core.busy):
                assert core.scheduler.add(f"p{len(requests)}", prompts[len(requests)], params) is None
                requests.append(core.scheduler.requests[f"p{len(requests)}"])
            if not core.busy:
                return requests
            await core.step()
            if check:
                check(core.scheduler)
        raise AssertionError("the engine did not finish")
    requests = asyncio.run(serve())
    core.runner.device.synchronize()
    return core, requests


@pytest.mark.parametrize("flags", [ALGORITHMS["none"], ALGORITHMS["eagle"] + ["--page-size", "4"]],
                         ids=["none", "eagle-page-4"])
def test_a_small_pool_evicts_and_keeps_every_page_in_one_place(flags, many_prefixes):
    core, requests = serve_arriving(flags + SMALL_POOL, many_prefixes, check=check_pool)
    _, alone = serve_arriving(flags + SMALL_POOL + ["--disable-radix-cache"], many_prefixes)
    assert [r.output_ids for r in requests] == [r.output_ids for r in alone]
    pool, stats = core.scheduler.pool, core.scheduler.pool.cache.stats
    assert stats.evicted_pages > 0 and stats.hit_tokens > 0
    assert sum(r.cached_tokens > 0 for r in requests) > len(requests) // 3
    assert pool.used_slots == 0 and not core.scheduler.requests
    assert core.scheduler.flush_cache() == ""
    assert sorted(pool.free_pages) == list(range(pool.num_pages)) and pool.cache.pages == 0


# ---- the trace ---------------------------------------------------------------------------------

def test_the_trace_shows_what_each_admitted_request_read_from_the_cache(waves, tmp_path):
    path = tmp_path / "trace.json"
    tracer = Tracer(str(path), 0)
    requests = serve_waves(build_core(parse_args(BASE + CASES["none"]), CpuDevice(), frozenset(), tracer), waves)
    tracer.close()
    spans = [event for event in json.loads(path.read_text()) if event["name"].startswith("schedule ")]
    admitted = [entry for span in spans for entry in span["args"].get("admitted", [])]
    assert admitted == [{"rid": r.rid, "tokens": len(r.input_ids), "cached": r.cached_tokens} for r in requests]
    assert sum(entry["cached"] > 0 for entry in admitted) == 5        # the second wave's, and the next turn


# ---- what the soak's determinism check stands on ------------------------------------------------

def test_in_float32_a_seeded_answer_does_not_depend_on_the_prefill_chunking(capsys):
    """A request that reads a cached prefix computes the rest in other chunks: in float32 with an unquantized
    EAGLE head its seeded answer is the one it gives alone (docs/prefix-cache.md: "Determinism")."""
    from bench import chunking
    chunking.main(["--num-prompts", "8", "--max-new-tokens", "16", "--chunks", "2048,7", "--sampling", "seeded",
                   "--dtype", "float32", *ALGORITHMS["eagle"], "--speculative-draft-quantization", "none"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompts"] == 8 and result["chunks"]["7"]["answers_differ"] == 0
    assert result["chunks"]["7"]["max_first_logprob_change"] < 1e-4
