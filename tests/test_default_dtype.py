"""The CPU's default dtype (--dtype auto): bfloat16 where the native kernels multiply bf16 pairs in
hardware, else float32, and float32 with quantized weights; the default server says which it runs, and its greedy
tokens are those of transformers running the same weights in bfloat16."""
from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch

from devices import cpu_native
from engine.messages import SamplingParams
from engine.models.loader import load_model, resolve_dtype
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import engine, run_batch
from tests.server_harness import DENSE, running_server

kernels = cpu_native.cpu_kernels("auto")
HAS_BF16 = kernels is not None and kernels.bf16_native()


def test_auto_follows_the_kernels_and_the_cpu(monkeypatch):
    monkeypatch.setattr("engine.models.loader.auto_cpu_dtype", cpu_native.auto_cpu_dtype)   # tests/conftest.py
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if HAS_BF16 else torch.float32)
    assert resolve_dtype("auto", "cpu", cpu_kernels="torch") == torch.float32      # torch's bf16 products are slower
    assert resolve_dtype("auto", "cpu", quantization="int8") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    # loading a model resolves auto for the path it loads
    assert load_model(DENSE, "auto", "cpu", cpu_kernels="torch")[0].embed_tokens.weight.dtype == torch.float32


TOLERANCE = 0.25          # logits; bf16 rounds at about 0.4% of a value


@pytest.mark.slow
@pytest.mark.skipif(not HAS_BF16, reason="needs the native kernels multiplying bf16 pairs in hardware")
def test_the_default_server_says_it_runs_bfloat16(tmp_path):
    with running_server(["--model-path", str(DENSE), "--dtype", "auto"], tmp_path / "server.log") as server:
        body = json.dumps({"model": DENSE.name, "prompt": "def add(a, b):", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.load(response)["choices"][0]["text"]
    log = (tmp_path / "server.log").read_text()
    assert "dtype bfloat16 (--dtype auto" in log
    threads = os.cpu_count() or 1            # the stream's threads (engine/rank_main.py: cpu_threads)
    assert (f"each layer stack in one parallel region of {threads} threads" in log) == (threads > 1)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_BF16, reason="needs the native kernels multiplying bf16 pairs in hardware")
async def test_default_greedy_tokens_are_transformers_bfloat16_choices():
    """Each greedy token of the default (bf16) ranks, fed back to transformers in bf16, is its
    argmax up to bf16's rounding of the logits; most are its argmax exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tok.encode(p) for p in CODE_PROMPTS[:4]]
    async with engine(["--model-path", str(DENSE), "--dtype", "auto", "--speculative-algorithm", "none"]) as client:
        answers = await run_batch(client, prompts, SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.bfloat16).eval()
    exact = total = 0
    for ids, (tokens, _) in zip(prompts, answers):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((chosen >= logits.max(dim=1).values - TOLERANCE).all()), (ids, tokens)
        exact += int((logits.argmax(dim=1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    assert exact >= 0.9 * total
