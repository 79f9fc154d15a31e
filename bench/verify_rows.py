"""A verify forward's rows read at once or four at a time, in one process: the native kernels' float vector
passes take a run of 5 or 6 rows (a verify of 4-5 drafts and its bonus token) in one pass where their sums
fit the vector registers (devices/cpu_kernels.cpp: in_row_runs); `set_wide_row_runs(False)` reads them four
at a time. The two alternate forward by forward on the same model and cache, so a noisy neighbour hits
both alike; also checks that both give the same logits.

    python bench/verify_rows.py --threads 2 [--dtype bfloat16,float32] [--quantization w8a8_int8]
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
from engine.models.testing import PagedRunner  # noqa: E402


@torch.inference_mode()
def compare(model, q: int, context: int, forwards: int) -> tuple[float, float, bool]:
    """(ms a forward with wide runs, ms four rows at a time, same logits) for one sequence adding q tokens."""
    kernels = model.kernels
    runner = PagedRunner(model.kv_layout(), model.embed_tokens.weight.dtype, max_context=context + q + 8)
    model(*runner.step([(0, list(range(1, context + 1)))]))
    ids, batch = runner.step([(0, [5] * q)])
    times: dict[bool, list[float]] = {True: [], False: []}
    logits = {}
    try:
        for i in range(forwards):
            for wide in ((True, False) if i % 2 else (False, True)):
                kernels.set_wide_row_runs(wide)
                start = time.perf_counter()
                logits[wide] = model.compute_logits(model(ids, batch).hidden)
                times[wide].append(time.perf_counter() - start)
    finally:
        kernels.set_wide_row_runs(True)
    return (statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3,
            torch.equal(logits[True], logits[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tandem-dense"))
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--quantization", default=None, choices=["w8a8_int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,5,6", help="comma-separated verify sizes")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--forwards", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype.split(","):
        model = load_model(args.model, dtype, "cpu", cpu_kernels="native", quantization=args.quantization)[0]
        for q in (int(t) for t in args.tokens.split(",")):
            wide, four, same = compare(model, q, args.context, args.forwards)
            print(f"{dtype}{' ' + args.quantization if args.quantization else ''}, 1 x {q}: {wide:.3f} ms at once, "
                  f"{four:.3f} ms four rows at a time ({wide / four:.3f}x); same logits: {same}", flush=True)


if __name__ == "__main__":
    main()
