"""The memory bandwidth a decode step is held to: how fast this machine's cores read a buffer far larger than
the caches, through a few of torch's reductions (each a plain read of every byte), the best of --repeats;
with --model, a one-token decode step of the model alternated with those reads, as a fraction of them.

    python bench/bandwidth.py [--gib 1] [--threads 2] [--repeats 10]
    python bench/bandwidth.py --model .build/models/llama-270m --dtype float32 [--quantization int4]
    python bench/bandwidth.py --model .build/models/llama-270m --quantization int4 --switch weight_prefetch

A decode step of one request reads every weight once, so its time can be no shorter than the weights' bytes
over this rate. The machine's rate moves (other tenants share its memory), so --model measures each step
right after a read of the buffer and quotes the median of step rate / read rate over --repeats pairs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

READS = {
    "sum": lambda x: x.sum(),
    "amax": lambda x: x.amax(),
    "dot": lambda x: torch.dot(x, x),
}


def best_gbs(read, x: torch.Tensor, repeats: int) -> float:
    read(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        read(x)
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best / 1e9


def weight_bytes(model) -> int:
    """Bytes a one-token decode step reads: every product's weight as the kernels hold it (packed, with its
    scales), the LM head once."""
    from engine.models.layers import NativeLinear
    from engine.models.quant import QuantizedLinear
    heads = {id(getattr(m, "lm_head", None)) for m in model.modules()}
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += sum(t.numel() * t.element_size() for t in (module.packed, module.scale))
        elif isinstance(module, NativeLinear) and id(module) not in heads:
            total += module.native_weight.numel() * module.native_weight.element_size()
    if model._modules.get("lm_head_quantized") is None:
        head = model.native_lm_head()
        total += head.numel() * head.element_size()
    return total


def decode_fraction(args, x: torch.Tensor) -> None:
    """A decode step of one token, alternated with the best read: the median of their rates' ratio. With
    --switch, each read is followed by a step with that tuning switch on and one with it off (in turns
    first), and both medians are printed with the median of their paired ratio."""
    import statistics

    from devices.cpu_native import cpu_kernels
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner
    model = load_model(args.model, args.dtype, "cpu", quantization=args.quantization)[0]
    size = weight_bytes(model)
    sides = (True, False) if args.switch else (True,)
    kernels = cpu_kernels() if args.switch else None
    if args.switch and (kernels is None or args.switch not in kernels.set_tuning()):
        raise SystemExit(f"--switch {args.switch}: not a tuning switch of native kernels this machine runs")
    runner = PagedRunner(model.kv_layout(), model.embed_tokens.weight.dtype, max_requests=1,
                         max_context=32 + 2 * len(sides) * args.repeats)
    fractions = {side: [] for side in sides}
    steps = {side: [] for side in sides}
    before = kernels.set_tuning(**{args.switch: True}) if kernels else None
    try:
        with torch.inference_mode():
            model(*runner.step([(0, list(range(1, 33)))]))
            for repeat in range(args.repeats):
                read = max(best_gbs(r, x, 1) for r in READS.values())
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    if kernels:
                        kernels.set_tuning(**{args.switch: side})
                    ids, batch = runner.step([(0, [5])])
                    start = time.perf_counter()
                    model.compute_logits(model(ids, batch).hidden)
                    seconds = time.perf_counter() - start
                    steps[side].append(seconds)
                    fractions[side].append(size / seconds / 1e9 / read)
    finally:
        if kernels:
            kernels.set_tuning(**before)
    for side in sides:
        label = f", {args.switch} {'on' if side else 'off'}" if args.switch else ""
        print(f"{args.model} ({args.dtype}, {args.quantization or 'no quantization'}{label}): {size / 1e6:.0f} MB a "
              f"step, median step {statistics.median(steps[side]) * 1e3:.2f} ms, median fraction of the read rate "
              f"beside it {statistics.median(fractions[side]):.2f}")
    if args.switch:
        ratio = statistics.median(on / off for on, off in zip(fractions[True], fractions[False]))
        print(f"{args.switch} on / off, paired: {ratio:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="Buffer size.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", help="A model folder: its decode step as a fraction of the read rate.")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, choices=("int8", "w8a8_int8", "int4"))
    parser.add_argument("--switch", default=None,
                        help="A tuning switch of the native kernels (devices/native/common.h), e.g. weight_prefetch: "
                             "steps with it on and off, alternated.")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.ones(int(args.gib * 2**30) // 4)
    rates = {name: best_gbs(read, x, args.repeats) for name, read in READS.items()}
    print(f"{torch.get_num_threads()} threads, {args.gib:g} GiB float32: "
          + ", ".join(f"{name} {gbs:.1f} GB/s" for name, gbs in rates.items())
          + f"; best {max(rates.values()):.1f} GB/s")
    if args.model:
        decode_fraction(args, x)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
