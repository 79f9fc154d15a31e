"""One linear layer's product on the CPU, through each path PyTorch offers and Tandem's native kernels,
at the shapes of a model's layers: plain F.linear (f32), oneDNN with a prepacked weight (f32 and bf16),
MKL's packed f32; the native products in f32 (vectors; packed for AVX-512 vectors where the CPU has
them), bf16 (vectors; AMX tiles or AVX512-BF16 vectors on a packed weight where the CPU has them),
int8 weight-only and w8a8_int8 (int8 activations; AMX int8 tiles or AVX512-VNNI where they run, else
the plain loop, which is measured beside them)
(devices/cpu_kernels.cpp).

    python bench/cpu_linear.py                           # tandem-dense's shapes, M = 1 and 16
    python bench/cpu_linear.py --shapes 4096x4096,11008x4096 --rows 1,8
    python bench/cpu_linear.py --weights 1 --rows 1,8,64  # warm: one weight, read from cache

Each product cycles through --weights distinct weight matrices, so that a weight is not in cache when it
is read (as in a forward, which reads every layer's weights once); the bandwidth column is the f32 weight
bytes over F.linear's median time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from devices import cpu_native  # noqa: E402
from engine.models.quant import NATIVE_MAX_ROWS as INT8_MAX_ROWS  # noqa: E402
from engine.models.quant import int8_pack, quantize_weight, w8a8_pack  # noqa: E402

# tandem-dense: q/k/v stacked, gate/up stacked, down, the LM head
DEFAULT_SHAPES = "512x256,1536x256,256x768,256x256,4096x256"


def median_us(fn, repeats: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def cycling(products: list):
    """A callable that runs the next product of the list each time."""
    state = {"i": 0}

    def run() -> None:
        state["i"] = (state["i"] + 1) % len(products)
        products[state["i"]]()
    return run


def paths(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    rows = x.shape[0]
    xb = x.to(torch.bfloat16)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    packed_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), rows) for w in weights]
    found = {
        "F.linear f32": [lambda w=w: F.linear(x, w) for w in weights],
        "oneDNN f32": [lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
        "oneDNN bf16": [lambda p=p: torch.ops.mkldnn._linear_pointwise(xb, p, None, "none", [], "")
                        for p in packed_bf16],
    }
    if torch.backends.mkl.is_available():
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w) for w in weights]
        found["MKL packed f32"] = [lambda m=m, w=w: torch.ops.mkl._mkl_linear(x, m, w, None, rows) for m, w in mkl]
    found.update(native_paths(x, weights))
    return found


def native_paths(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """The native kernels' products as the model calls them (NativeLinear, Int8Linear), where they
    build and take these rows; float32 and bf16 from the weight as loaded (few_row_product's vectors), and
    packed by tile_pack where it packs (float32: AVX-512 vectors; bf16: AMX tiles, or AVX512-BF16 vectors
    over the same blocks)."""
    kernels = cpu_native.cpu_kernels("auto")
    if kernels is None:
        return {}
    rows, xb = x.shape[0], x.to(torch.bfloat16)
    found = {}
    if rows <= kernels.FLOAT_LINEAR_MAX_ROWS:
        found["native f32"] = [lambda w=w: kernels.linear(x, w, None) for w in weights]
        if kernels.HAS_BF16_PRODUCT:
            bf16 = [w.to(torch.bfloat16) for w in weights]
            found["native bf16 vectors"] = [lambda w=w: kernels.linear(xb, w, None) for w in bf16]
    f32_packs = [kernels.tile_pack(w) for w in weights]
    if f32_packs[0].dim() == 3:
        found["native f32 packed"] = [lambda p=p: kernels.linear(x, p, None) for p in f32_packs]
    tiles = [kernels.tile_pack(w.to(torch.bfloat16)) for w in weights]
    if tiles[0].dim() == 5:
        found["native bf16 packed"] = [lambda t=t: kernels.linear(xb, t, None) for t in tiles]
    if rows <= INT8_MAX_ROWS:
        int8 = [(int8_pack(q), scale) for q, scale in map(quantize_weight, weights)]
        found["native int8"] = [lambda p=p, s=s: kernels.int8_linear(x, p, s, None) for p, s in int8]
    w8a8 = [(w8a8_pack(q), scale) for q, scale in map(quantize_weight, weights)]
    found["native w8a8"] = [lambda p=p, s=s: kernels.w8a8_linear(x, p, s, None) for p, s in w8a8]
    found["native w8a8 bf16"] = [lambda p=p, s=s: kernels.w8a8_linear(xb, p, s, None) for p, s in w8a8]
    if kernels.w8a8_fast_run():
        found["native w8a8 plain loop"] = [lambda p=p, s=s: w8a8_plain_loop(kernels, x, p, s) for p, s in w8a8]
    return found


def w8a8_plain_loop(kernels, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8a8_linear with its AMX or VNNI sums turned off: the plain loop, the same sums."""
    kernels.set_w8a8_fast(False)
    try:
        return kernels.w8a8_linear(x, packed, scale, None)
    finally:
        kernels.set_w8a8_fast(True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="Comma list of OUTxIN weight shapes.")
    parser.add_argument("--rows", default="1,16", help="Comma list of batch rows (M).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    parser.add_argument("--weights", type=int, default=40, help="Distinct weights cycled through.")
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; median µs per product")
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            out_features, in_features = (int(v) for v in shape.split("x"))
            weights = [torch.randn(out_features, in_features) for _ in range(args.weights)]
            x = torch.randn(rows, in_features)
            cells = {name: median_us(cycling(products), args.repeats) for name, products in paths(x, weights).items()}
            bandwidth = out_features * in_features * 4 / cells["F.linear f32"] / 1e3
            print(f"M={rows:<3} {shape:>10}: " + ", ".join(f"{name} {us:7.1f}" for name, us in cells.items())
                  + f"  (F.linear reads {bandwidth:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
