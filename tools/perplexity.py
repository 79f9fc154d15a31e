"""Held-out perplexity of an embedded model as Tandem runs it, with and without quantization.

    python tools/perplexity.py --model models/tandem-dense --variant none --variant int8 --variant q8_0

Text: the held-out split of the model's training data (Python standard library files whose path
hash puts them out of training, tools/tiny_corpus.py), as one `<|endoftext|>`-separated stream cut
into windows of --window tokens; each window is one prompt through Tandem's model code (paged KV
cache, the CPU kernels the server would use), and every token after the first is scored.

Variants: `none` (the weights as loaded), `int8` (`--quantization int8`: one scale per output
channel), `w8a8_int8` (`--quantization w8a8_int8`: the same weights against activations quantized
to int8 row by row, as Tandem runs them), `q8_0` (llama.cpp's q8_0 format simulated on the same
weights: blocks of 32 inputs, one scale each, rounded to float16; the products then run in float32,
so this is the format's weight error alone, not llama.cpp's int8 activations).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from engine.models.loader import load_model  # noqa: E402
from engine.models.testing import PagedRunner  # noqa: E402

VARIANTS = ("none", "int8", "w8a8_int8", "q8_0")


def q8_0_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """The weight as llama.cpp's q8_0 stores it: per block of 32 inputs, d = max|w| / 127 in float16,
    q = round(w / d) in int8; returned dequantized (q * d)."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"q8_0 needs a multiple of 32 inputs, got {k}")
    blocks = weight.float().view(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127.0).half().float()
    q = torch.where(d > 0, torch.round(blocks / d.clamp(min=1e-30)), torch.zeros_like(blocks)).clamp(-127, 127)
    return (q * d).view(n, k).to(weight.dtype)


def apply_q8_0(model: nn.Module) -> None:
    """Every linear weight and the LM head (tied: the embedding too, as llama.cpp quantizes token_embd) through q8_0."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(q8_0_roundtrip(module.weight))
        head = model.lm_head_weight()
        head.copy_(q8_0_roundtrip(head))


def load_variant(path: str, variant: str, dtype: torch.dtype):
    model, _ = load_model(path, dtype, "cpu", quantization=variant if variant in ("int8", "w8a8_int8") else None)
    if variant == "q8_0":
        apply_q8_0(model)
    return model


def heldout_windows(tokenizer_dir: str, window: int, max_tokens: int) -> list[list[int]]:
    import tiny_corpus
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.model_max_length = 10**9
    stream: list[int] = []
    for _, text in tiny_corpus.heldout_texts():
        stream += [0] + tok(text, add_special_tokens=False).input_ids
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    return [stream[i:i + window] for i in range(0, len(stream) - 1, window) if len(stream[i:i + window]) > 1]


@torch.inference_mode()
def perplexity(model, windows: list[list[int]], dtype: torch.dtype) -> tuple[float, int]:
    nll, scored = 0.0, 0
    runner = PagedRunner(model.kv_layout(), dtype, max_requests=1, max_context=max(map(len, windows)))
    for window in windows:
        runner.reset(0)
        ids, batch = runner.step([(0, window)])
        logits = model.compute_logits(model(ids, batch).hidden)
        nll += F.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
        scored += len(window) - 1
    return math.exp(nll / scored), scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tandem-dense"))
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeat; default: all")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens scored (from the start)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    windows = heldout_windows(args.model, args.window, args.max_tokens)
    results = {}
    for variant in args.variant or VARIANTS:
        start = time.perf_counter()
        ppl, scored = perplexity(load_variant(args.model, variant, dtype), windows, dtype)
        results[variant] = {"perplexity": ppl, "tokens": scored}
        base = results.get("none", {}).get("perplexity")
        ratio = f"  ({ppl / base - 1:+.2%} against none)" if base and variant != "none" else ""
        print(f"{variant:9s} perplexity {ppl:.4f} over {scored} held-out tokens{ratio}  "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "window": args.window,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
