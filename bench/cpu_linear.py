"""One linear layer's product on the CPU at a model's shapes, through torch and through each of Tandem's
native formats (devices/native/products.h): torch's F.linear in float32 and bf16, oneDNN with a prepacked
weight where torch's build and the CPU offer it, MKL's packed float32; the native float32, bfloat16, int8,
w8a8_int8 and int4 products, each also on its portable vectors where the build has an ISA-specific path
for it (`portable` columns: AVX512-BF16, VNNI, AVX2's integer sums turned off).

    python bench/cpu_linear.py                                  # a 270M Llama's shapes, M = 1, 8 and 20
    python bench/cpu_linear.py --shapes 4096x4096,11008x4096 --rows 1,8 --paths native
    python bench/cpu_linear.py --weights 1 --rows 1,8,64        # warm: one weight, read from cache

Each product cycles through --weights distinct weight matrices, so that a weight is not in cache when it is
read (as in a forward, which reads every layer's weights once). Printed: the median µs of each path, and
for each native format the GB/s its weight bytes were read at.
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
from engine.models import quant  # noqa: E402

# a 270M Llama (bench/make_model.py 270m): q/k/v stacked, o, gate/up stacked, down, the LM head
DEFAULT_SHAPES = "1536x1024,1024x1024,5632x1024,1024x2816,4096x1024"
FORMATS = ("float32", "bfloat16", "int8", "w8a8_int8", "int4")


def median_us(fn, repeats: int) -> float:
    for _ in range(min(20, repeats)):
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


def torch_paths(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """torch's products; oneDNN's prepacked ones only where this torch and CPU pack them (bf16 needs
    AVX-512 or AVX-NE-CONVERT: elsewhere the column is left out, not an error)."""
    rows, xb = x.shape[0], x.to(torch.bfloat16)
    bf16 = [w.to(torch.bfloat16) for w in weights]
    found = {"torch f32": [lambda w=w: F.linear(x, w) for w in weights],
             "torch bf16": [lambda w=w: F.linear(xb, w) for w in bf16]}
    for name, inputs, ws in (("oneDNN f32", x, weights), ("oneDNN bf16", xb, bf16)):
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            torch.ops.mkldnn._linear_pointwise(inputs, packed[0], None, "none", [], "")
        except (RuntimeError, AttributeError):
            continue
        found[name] = [lambda p=p, i=inputs: torch.ops.mkldnn._linear_pointwise(i, p, None, "none", [], "")
                       for p in packed]
    if torch.backends.mkl.is_available():
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w) for w in weights]
        found["MKL packed f32"] = [lambda m=m, w=w: torch.ops.mkl._mkl_linear(x, m, w, None, rows) for m, w in mkl]
    return found


def packed_weights(kernels, fmt: str, weights: list[torch.Tensor]) -> list[tuple]:
    """(packed, scale) of each weight in `fmt`."""
    if fmt in ("float32", "bfloat16"):
        return [(kernels.pack_float(w.to(getattr(torch, fmt))), None) for w in weights]
    layers = [quant.QUANTIZED_LINEAR[fmt](w, None) for w in weights]
    return [(layer.packed, layer.scale) for layer in layers]


def portable(kernels, run):
    """run with the ISA-specific products turned off (the portable vectors, the same formats)."""
    def call():
        before = kernels.set_tuning(isa_products=False)
        try:
            run()
        finally:
            kernels.set_tuning(**before)
    return call


def native_paths(kernels, x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[dict, dict]:
    """The native products of each format ({name: products}) and each format's weight bytes."""
    xb = x.to(torch.bfloat16)
    found, sizes = {}, {}
    for fmt in FORMATS:
        held = packed_weights(kernels, fmt, weights)
        inputs = xb if fmt == "bfloat16" else x
        runs = [lambda p=p, s=s, i=inputs: kernels.linear(i, p, None, s) for p, s in held]
        name = f"native {fmt}"
        found[name] = runs
        sizes[name] = sum(t.numel() * t.element_size() for t in held[0] if t is not None)
        before = kernels.set_tuning(isa_products=False)
        isa_path = kernels.product_path(fmt)
        kernels.set_tuning(**before)
        if isa_path != kernels.product_path(fmt):
            found[f"{name} portable"] = [portable(kernels, run) for run in runs]
            sizes[f"{name} portable"] = sizes[name]
    return found, sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="Comma list of OUTxIN weight shapes.")
    parser.add_argument("--rows", default="1,8,20", help="Comma list of batch rows (M).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    parser.add_argument("--weights", type=int, default=16, help="Distinct weights cycled through.")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--paths", choices=("all", "native", "torch"), default="all")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_native.cpu_kernels("auto") if args.paths != "torch" else None
    built = f"native kernels built for {cpu_native.build_arch()}" if kernels is not None else "no native kernels"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {built}; median µs per product")
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            out_features, in_features = (int(v) for v in shape.split("x"))
            gen = torch.Generator().manual_seed(0)
            weights = [torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
                       for _ in range(args.weights)]
            x = torch.randn(rows, in_features, generator=gen)
            found, sizes = {}, {}
            if args.paths != "native":
                found.update(torch_paths(x, weights))
            if kernels is not None:
                native, sizes = native_paths(kernels, x, weights)
                found.update(native)
            cells = {name: median_us(cycling(products), args.repeats) for name, products in found.items()}
            print(f"M={rows:<3} {shape:>10}: " + ", ".join(
                f"{name} {us:7.1f}" + (f" ({sizes[name] / us / 1e3:.1f} GB/s)" if name in sizes else "")
                for name, us in cells.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
