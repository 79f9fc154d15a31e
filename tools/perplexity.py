"""Held-out perplexity of an embedded model as Tandem runs it, with and without quantization, and (with
--llama-cpp) llama.cpp's own for its q8_0 and q4_0 on the same weights.

    python tools/perplexity.py --model models/tandem-dense --variant none --variant int8 --variant q8_0
    python tools/perplexity.py --variant none --variant int4 --variant q4_0 --llama-cpp PATH/TO/llama.cpp

Text: the held-out split of the model's training data (Python standard library files whose path
hash puts them out of training, tools/tiny_corpus.py), as one `<|endoftext|>`-separated stream cut
into windows of --window tokens; each window is one prompt through Tandem's model code (paged KV
cache, the CPU kernels the server would use), and every token after the first is scored.

Variants: `none` (the weights as loaded), `int8` (`--quantization int8`: one scale per output
channel), `w8a8_int8` (`--quantization w8a8_int8`: the same weights against activations quantized
to int8 row by row, as Tandem runs them), `int4` (`--quantization int4`: q4_0's groups of 32 with
float16 scales, each group of activations quantized to int8, as Tandem runs it), `q8_0` and `q4_0`
(llama.cpp's formats simulated on the same weights: blocks of 32 inputs, one float16 scale each; the
products then run in float32, so this is the format's weight error alone, not llama.cpp's int8
activations).

--llama-cpp DIR: llama.cpp's `llama-perplexity` on GGUF conversions of the same weights (f32, q8_0, q4_0;
bench/baseline_llamacpp.py makes them) over the same held-out text. It scores the second half of each
--window tokens, Tandem every token after a window's first, so compare each side's ratio to its own f32.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from devices.cpu_native import cpu_kernels  # noqa: E402
from engine.models.layers import use_cpu_kernels  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.testing import PagedRunner  # noqa: E402

VARIANTS = ("none", "int8", "w8a8_int8", "int4", "q8_0", "q4_0")
LLAMA_CPP_TYPES = ("f32", "q8_0", "q4_0")


def q4_0_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """The weight as llama.cpp's q4_0 stores it (engine/models/quant.py: quantize_int4 follows its rule),
    returned dequantized."""
    from engine.models.quant import quantize_int4
    n, k = weight.shape
    q, d = quantize_int4(weight)
    return (q.float().view(n, -1, 32) * d.float()[..., None]).view(n, -1)[:, :k].to(weight.dtype)


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


def apply_roundtrip(model: nn.Module, roundtrip) -> None:
    """Every linear weight and the LM head (tied: the embedding too, as llama.cpp quantizes token_embd) through
    a format's round trip."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(roundtrip(module.weight))
        head = model.lm_head_weight()
        head.copy_(roundtrip(head))


def load_variant(path: str, variant: str, dtype: torch.dtype):
    if variant not in ("q8_0", "q4_0"):
        return load_model(path, dtype, "cpu", quantization=None if variant == "none" else variant)[0]
    # the matrices as loaded (the kernels keep only packed ones), through the format, then packed
    model = load_model(path, dtype, "cpu", cpu_kernels="torch")[0]
    apply_roundtrip(model, q8_0_roundtrip if variant == "q8_0" else q4_0_roundtrip)
    use_cpu_kernels(model, cpu_kernels("auto"))
    return model


def heldout_stream(tokenizer_dir: str, max_tokens: int) -> tuple[list[int], str]:
    """The held-out token stream (texts joined by <|endoftext|>) and its text (joined by blank lines)."""
    import tiny_corpus
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.model_max_length = 10**9
    stream: list[int] = []
    texts: list[str] = []
    for _, text in tiny_corpus.heldout_texts():
        stream += [0] + tok(text, add_special_tokens=False).input_ids
        texts.append(text)
        if len(stream) >= max_tokens:
            break
    return stream[:max_tokens], "\n\n".join(texts)


def heldout_windows(tokenizer_dir: str, window: int, max_tokens: int) -> list[list[int]]:
    stream = heldout_stream(tokenizer_dir, max_tokens)[0]
    return [stream[i:i + window] for i in range(0, len(stream) - 1, window) if len(stream[i:i + window]) > 1]


def llama_cpp_perplexities(args) -> dict:
    """llama-perplexity on each of LLAMA_CPP_TYPES of the model over the held-out text: {type: {perplexity,
    chunks}}."""
    import re
    import subprocess
    import tempfile

    from bench import baseline_llamacpp
    root = Path(args.llama_cpp)
    binary = root / "build" / "bin" / "llama-perplexity"
    if not binary.is_file():
        raise SystemExit(f"error: {binary} is missing: build it (cmake --build build --target llama-perplexity)")
    text = heldout_stream(args.model, args.max_tokens)[1]
    chunks = max(1, args.max_tokens // args.window)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "heldout.txt"
        text_file.write_text(text)
        for outtype in LLAMA_CPP_TYPES:
            gguf_args = argparse.Namespace(model_path=args.model, gguf_dir=args.gguf_dir, threads=args.threads,
                                           outtype=outtype)
            tools = baseline_llamacpp.llama_paths(root, None, outtype)
            gguf = baseline_llamacpp.gguf_for(gguf_args, tools, outtype)
            done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(args.window),
                                   "-b", str(args.window), "--chunks", str(chunks), "-t", str(args.threads)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # "[k]p," after each chunk: the perplexity of the first k chunks (the last lines of its log, which a
            # writer thread prints, are sometimes lost at exit: the last of these read stands for the whole)
            running = re.findall(r"\[(\d+)\]([0-9.]+),", done.stdout)
            if done.returncode != 0 or not running:
                raise SystemExit(f"error: llama-perplexity on {gguf} failed:\n{done.stdout[-2000:]}")
            scored, ppl = int(running[-1][0]), float(running[-1][1])
            found[outtype] = {"perplexity": ppl, "chunks": scored}
            base = found["f32"]["perplexity"]
            ratio = f"  ({ppl / base - 1:+.2%} against f32)" if outtype != "f32" else ""
            print(f"llama.cpp {outtype:5s} perplexity {ppl:.4f} over {scored} chunks of {args.window}{ratio}",
                  flush=True)
    return found


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
    parser.add_argument("--llama-cpp", help="a llama.cpp checkout with build/bin/llama-perplexity: its perplexity "
                                            "of f32, q8_0 and q4_0 GGUFs of the same weights too")
    parser.add_argument("--gguf-dir", default=str(Path(tempfile.gettempdir()) / "tandem-gguf"))
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity's threads")
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
    llama_cpp = llama_cpp_perplexities(args) if args.llama_cpp else None
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "window": args.window,
                                               "results": results, "llama_cpp": llama_cpp}, indent=2))


if __name__ == "__main__":
    main()
