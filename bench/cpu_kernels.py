"""One model forward on the CPU, in-process, on each path: pure torch, the native kernels, the native
kernels with quantized weights (int8, w8a8_int8, int4), and the native kernels with one part undone for a
side-by-side measure of it (float products through torch on the weights as loaded; the portable vectors
instead of the ISA-specific products; attention fetching no key or value row ahead; the vector passes four
rows at a time instead of 5-6 at once; a parallel region per kernel loop instead of one a layer stack; a
dense model: its layers called one by one instead of in one call; an MoE model: its experts through the
grouped Python loop instead of one call); for decodes, verify-like runs and prompts.

    python bench/cpu_kernels.py --threads 2 [--model models/tandem-dense] [--rounds 2] [--paths native,...]

Each case: `rows` sequences, each adding `q` tokens to a context of --context tokens (the context
grows by q a step, --steps steps; medians of the steps after the first five), or one prompt of
`prompt` tokens. Paths run alternately, --rounds times, so a noisy neighbour hits all of them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from engine.models.loader import load_model  # noqa: E402
from engine.models.moe import StackedExperts  # noqa: E402
from engine.models.testing import PagedRunner  # noqa: E402

PATHS = {"torch": {"cpu_kernels": "torch"}, "native": {"cpu_kernels": "native"},
         "native-int8": {"cpu_kernels": "native", "quantization": "int8"},
         "native-w8a8": {"cpu_kernels": "native", "quantization": "w8a8_int8"},
         "native-int4": {"cpu_kernels": "native", "quantization": "int4"}}
EXPERT_LOOP = "native-expert-loop"          # MoE models
PER_LAYER = "native-per-layer"              # dense models
TORCH_PRODUCTS = "native-torch-products"    # weights as loaded, float products through torch (native_products)
# the tuning switch each path turns off while it runs (devices/native/common.h: Tuning)
SWITCHED = {"native-portable": "isa_products", "native-no-kv-prefetch": "kv_prefetch",
            "native-no-weight-prefetch": "weight_prefetch",
            "native-four-row-runs": "wide_row_runs", "native-regions": "teams"}
DECODE_CASES = [(1, 1), (1, 4), (1, 5), (1, 16), (16, 1), (16, 4), (16, 16)]      # (rows, q); 1 x 5: 4 drafts
PROMPTS = [64, 512]


def load(path: str, dtype: str, name: str):
    """The model on one path. EXPERT_LOOP: native kernels, the experts through StackedExperts'
    grouped loop; PER_LAYER: native kernels, one dense_layer call per layer (what ran before
    their native calls: dense_layers, moe_experts)."""
    from devices.cpu_native import build
    before = build().set_tuning(native_products=False) if name == TORCH_PRODUCTS else None
    try:          # loaded with the native products off: no weight packs, torch multiplies
        model = load_model(path, dtype, "cpu", **PATHS.get(name, PATHS["native"]))[0]
    finally:
        if before is not None:
            build().set_tuning(**before)
    if name == EXPERT_LOOP:
        for experts in (m for m in model.modules() if isinstance(m, StackedExperts)):
            experts.forward = experts.forward_grouped
    if name == PER_LAYER:
        model.native_stack = None
    return model


def measure(run, model, name: str) -> float:
    """run(model), with the path's tuning switch (SWITCHED) off while it runs (process-wide switches)."""
    kernels = getattr(model, "kernels", None)
    switch = SWITCHED.get(name)
    if kernels is None or switch is None:
        return run(model)
    before = kernels.set_tuning(**{switch: False})
    try:
        return run(model)
    finally:
        kernels.set_tuning(**before)


def is_moe(path: str) -> bool:
    return "num_experts" in (Path(path) / "config.json").read_text() or "num_local_experts" in \
        (Path(path) / "config.json").read_text()


def dtype_of(model) -> torch.dtype:
    return model.embed_tokens.weight.dtype


@torch.inference_mode()
def decode_ms(model, rows: int, q: int, context: int, steps: int) -> float:
    runner = PagedRunner(model.kv_layout(), dtype_of(model), max_requests=rows, max_context=context + steps * q + 8)
    ids, batch = runner.step([(r, list(range(1, context + 1))) for r in range(rows)])
    model(ids, batch)
    times = []
    for _ in range(steps):
        ids, batch = runner.step([(r, [5] * q) for r in range(rows)])
        start = time.perf_counter()
        model.compute_logits(model(ids, batch).hidden)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3


@torch.inference_mode()
def prompt_ms(model, tokens: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        runner = PagedRunner(model.kv_layout(), dtype_of(model), max_requests=1, max_context=tokens + 8)
        ids, batch = runner.step([(0, list(range(1, tokens + 1)))])
        start = time.perf_counter()
        model.compute_logits(model(ids, batch).hidden[-1:])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tandem-dense"))
    parser.add_argument("--dtype", default="float32", help="comma-separated: every path in each (float32, bfloat16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paths", default=None, help="comma-separated: only these paths (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtype.split(",")
    paths = list(PATHS) + [TORCH_PRODUCTS, *SWITCHED, EXPERT_LOOP if is_moe(args.model) else PER_LAYER]
    if args.paths:
        unknown = set(args.paths.split(",")) - set(paths)
        if unknown:
            parser.error(f"unknown paths {sorted(unknown)}; choose from {paths}")
        paths = args.paths.split(",")
    models = {(f"{name} {dtype}" if len(dtypes) > 1 else name): load(args.model, dtype, name)
              for dtype in dtypes for name in paths}
    columns = list(models)
    cases = [(f"{rows} x {q} tokens", lambda m, rows=rows, q=q: decode_ms(m, rows, q, args.context, args.steps))
             for rows, q in DECODE_CASES]
    cases += [(f"prompt of {n}", lambda m, n=n: prompt_ms(m, n)) for n in PROMPTS]
    width = max(14, *(len(c) + 2 for c in columns))
    print(f"{args.threads} threads, context {args.context}; ms a forward (with the LM head), medians over "
          f"{args.rounds} alternating rounds; ratios to '{columns[0]}'")
    print(f"{'case':>18}" + "".join(f"{c:>{width}}" for c in columns) + "".join(f"{c:>{width}}" for c in columns[1:]))
    for label, run in cases:
        samples: dict[str, list[float]] = {name: [] for name in columns}
        for round_ in range(args.rounds):
            for name in columns if round_ % 2 == 0 else reversed(columns):
                samples[name].append(measure(run, models[name], name.split()[0]))
        ms = {name: statistics.median(values) for name, values in samples.items()}
        print(f"{label:>18}" + "".join(f"{ms[c]:{width}.2f}" for c in columns)
              + "".join(f"{ms[c] / ms[columns[0]]:{width}.2f}" for c in columns[1:]), flush=True)


if __name__ == "__main__":
    main()
