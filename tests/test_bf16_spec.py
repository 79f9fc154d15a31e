"""bfloat16 on the native products (bf16 pairs in hardware, or widened on portable vectors): every
speculative algorithm gives plain greedy decoding's tokens, through rank processes. The products sum each
output the same way whatever the number of rows, so a verify run of k tokens reads the numbers k decode
steps would."""
from __future__ import annotations

import pytest

from devices import cpu_native
from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS, engine, run_batch
from tests.server_harness import DENSE

kernels = cpu_native.cpu_kernels("auto")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernels is None, reason="needs the native kernels")]
BF16 = ["--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(p) for p in CODE_PROMPTS[:6]]


async def outputs(flags: list[str], prompts: list[list[int]]) -> list[list[int]]:
    async with engine(flags + BF16) as client:
        answers = await run_batch(client, prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    return [tokens for tokens, _ in answers]


async def test_every_algorithm_in_bfloat16_equals_plain_greedy(prompts):
    plain = await outputs(ALGORITHMS["none"], prompts)
    for name in ("eagle", "eagle3", "standalone", "ngram"):
        assert await outputs(ALGORITHMS[name], prompts) == plain, name
