"""The engine on a CUDA GPU (skipped without one): overlapped speculative greedy decoding
equals plain greedy decoding on the device, in float32."""
from __future__ import annotations

import pytest
import torch

from engine.messages import SamplingParams
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import engine, run_batch
from tests.server_harness import DENSE, REPO

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


async def test_cuda_overlapped_eagle_equals_plain_greedy():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tok.encode(p) for p in CODE_PROMPTS[:8]]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    base = ["--model-path", str(DENSE), "--device", "cuda", "--dtype", "float32", "--max-total-tokens", "16384"]
    async with engine(base + ["--speculative-algorithm", "none"]) as client:
        plain = [t for t, _ in await run_batch(client, prompts, params)]
    eagle = ["--speculative-algorithm", "eagle",
             "--speculative-draft-model-path", str(REPO / "models/tandem-dense-eagle")]
    for overlap in ([], ["--disable-overlap-schedule"]):
        async with engine(base + eagle + overlap) as client:
            assert [t for t, _ in await run_batch(client, prompts, params)] == plain
