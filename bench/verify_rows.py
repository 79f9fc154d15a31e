"""A native kernels' switch on and off in one process, forward by forward. `--switch wide_row_runs` (the
default): a verify forward's rows read at once or four at a time (the float vector passes take a run of 5
or 6 rows, a verify of 4-5 drafts and its bonus token, in one pass where their sums fit the vector
registers: devices/native/products.h in_row_runs; off, they are read four at a time).
`--switch teams`: the layer stack in one parallel region, or a region per kernel loop.
`--switch own_rows`: in that region, at a few rows, each thread runs the row-wise steps over every row itself,
or they are shared out with a barrier after each. `--switch isa_products`: the ISA-specific products
(AVX512-BF16, VNNI, AVX2's integer sums) or the portable vectors. Each is a switch of the kernels' tuning
record (set_tuning).
The two alternate forward by forward on the same model and cache, so a noisy neighbour hits both alike;
also checks that both give the same logits.

    python bench/verify_rows.py --threads 2 [--dtype bfloat16,float32] [--quantization w8a8_int8]
    python bench/verify_rows.py --switch teams --seqs 1,16 --tokens 1,5
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


SWITCHES = {"wide_row_runs": ("at once", "four rows at a time"), "teams": ("in one region", "a region a loop"),
            "own_rows": ("row-wise steps each thread's own", "row-wise steps shared"),
            "isa_products": ("ISA-specific products", "portable vectors"),
            "paired_blocks": ("two blocks a run", "one block a run"),
            "widen_once": ("weights widened once a group", "widened in registers each run"),
            "weight_prefetch": ("weights fetched ahead", "the hardware prefetcher alone")}


@torch.inference_mode()
def compare(model, switch: str, seqs: int, q: int, context: int, forwards: int) -> tuple[float, float, bool]:
    """(ms a forward with the switch on, ms with it off, same logits) for `seqs` sequences adding q tokens each."""
    def turn(on: bool) -> None:
        model.kernels.set_tuning(**{switch: on})

    runner = PagedRunner(model.kv_layout(), model.embed_tokens.weight.dtype, max_requests=seqs,
                         max_context=context + q + 8)
    model(*runner.step([(s, list(range(1, context + 1))) for s in range(seqs)]))
    ids, batch = runner.step([(s, [5] * q) for s in range(seqs)])
    times: dict[bool, list[float]] = {True: [], False: []}
    logits = {}
    try:
        for i in range(forwards):
            for on in ((True, False) if i % 2 else (False, True)):
                turn(on)
                start = time.perf_counter()
                logits[on] = model.compute_logits(model(ids, batch).hidden)
                times[on].append(time.perf_counter() - start)
    finally:
        turn(True)
    return (statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3,
            torch.equal(logits[True], logits[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tandem-dense"))
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--quantization", default=None, choices=["int8", "w8a8_int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--switch", default="wide_row_runs", choices=sorted(SWITCHES))
    parser.add_argument("--seqs", default="1", help="comma-separated batch sizes")
    parser.add_argument("--tokens", default="1,5,6", help="comma-separated verify sizes")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--forwards", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype.split(","):
        model = load_model(args.model, dtype, "cpu", cpu_kernels="native", quantization=args.quantization)[0]
        on_words, off_words = SWITCHES[args.switch]
        for seqs in (int(b) for b in args.seqs.split(",")):
            for q in (int(t) for t in args.tokens.split(",")):
                on, off, same = compare(model, args.switch, seqs, q, args.context, max(2, args.forwards // seqs))
                print(f"{dtype}{' ' + args.quantization if args.quantization else ''}, {seqs} x {q}: {on:.3f} ms "
                      f"{on_words}, {off:.3f} ms {off_words} ({on / off:.3f}x); same logits: {same}", flush=True)


if __name__ == "__main__":
    main()
