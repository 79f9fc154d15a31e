"""The radix prefix cache on the embedded model, in-process: greedy outputs of requests that read
cached prefixes are plain greedy decoding's without any cache, for every speculative algorithm,
overlap on and off, one step and four a launch, pages of 1 and 4 tokens, CPU graphs.

The second wave's prompts meet the cache in each way that matters: the whole prompt sent again
(all but its last page read), a prompt that shares a prefix ending inside a page, one whose
uncached rest spans several prefill chunks (and whose match ends inside what was a chunk of the
prompt that left it), and a chat's next turn (an earlier prompt, its answer, a new question).
"""
from __future__ import annotations

import asyncio

import pytest

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.messages import SamplingParams
from engine.rank import build_core
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.server_harness import DENSE

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
BASE = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "4",
        "--chunked-prefill-size", "16", "--dtype", "float32"]


@pytest.fixture(scope="module")
def waves():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
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
    core = build_core(parse_args(BASE + flags), CpuDevice(), eos_ids=frozenset())
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
    return [r.output_ids for r in done + again], [r.cached_tokens for r in again]


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
