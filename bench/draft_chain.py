"""An EAGLE head's greedy draft chain in-process, two ways side by side: one native call
(LlamaForCausalLMEagle.draft_chain: devices/native/draft.cpp eagle_chain) and the worker's
step-by-step loop from Python (forward, compute_logits, top_choice, the keep rule); and the same for
its extend over a verify's tokens (extend_native: eagle_extend, against forward, the picked rows,
compute_logits and top_choice from Python).

    python bench/draft_chain.py --threads 2 [--dtype bfloat16] [--rows 1,16] [--steps 4]
    python bench/draft_chain.py --against regions [--quantization w8a8_int8]

`--against regions`: the native call against itself with a parallel region per kernel loop
(`set_tuning(teams=False)`), not the loop from Python: what running the chain's steps in one region gains.

Each of `rows` sequences holds --context tokens of a repeated prompt; a chain drafts --steps tokens
after the first with no trim (every step runs), so both ways do the same work; an extend reads
--steps + 1 tokens a row (a whole chain verified). Medians of --repeats chains, the two ways
alternating; also checks that both give the same drafts.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from engine.models.attention import chain_step_batch  # noqa: E402
from engine.models.loader import load_draft, load_model  # noqa: E402
from engine.models.testing import PagedRunner  # noqa: E402
from spec.chains import top_choice  # noqa: E402


def step_by_step(head, first, hidden, start, table, kv, steps):
    drafts, g = [first], hidden
    for i in range(1, steps + 1):
        g = head(drafts[-1], g, chain_step_batch(start + i - 1, table, kv))
        drafts.append(top_choice(head.compute_logits(g), True, head.kernels)[0])
    return torch.stack(drafts, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tandem-dense"))
    parser.add_argument("--draft", default=str(REPO / "models" / "tandem-dense-eagle"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, choices=["int8", "w8a8_int8"],
                        help="the head's weights (default: unquantized)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--against", default="python", choices=["python", "regions"],
                        help="the other way: the loop from Python, or the native call a region a loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_model(args.model, dtype, "cpu", cpu_kernels="native")[0]
    head = load_draft(args.draft, target, dtype, "cpu", cpu_kernels="native", quantization=args.quantization)[0]
    print(f"{Path(args.draft).name}, {args.dtype}, {args.quantization or 'unquantized'} head, {args.threads} threads, "
          f"{args.steps} steps a chain, context {args.context}")
    chain_words, extend_words, native_words = ("step by step", "from Python", "in one native call") \
        if args.against == "python" else ("a region a loop", "a region a loop", "in one region")
    for rows in (int(r) for r in args.rows.split(",")):
        other_us, native_us, same = time_chains(head, rows, dtype, args)
        print(f"rows {rows:3d}: a draft step {other_us:7.1f} us {chain_words}, {native_us:7.1f} us {native_words} "
              f"({native_us / other_us:.2f}x); same drafts: {same}")
        other_us, native_us, same = time_extends(head, rows, dtype, args)
        print(f"rows {rows:3d}: an extend {other_us:7.1f} us {extend_words}, {native_us:7.1f} us {native_words} "
              f"({native_us / other_us:.2f}x); same drafts: {same}")


def in_regions(native, kernels):
    """native() with a parallel region per kernel loop (teams off in the kernels' tuning), then as before."""
    def run():
        before = kernels.set_tuning(teams=False)
        try:
            return native()
        finally:
            kernels.set_tuning(**before)
    return run


@torch.inference_mode()
def time_chains(head, rows: int, dtype: torch.dtype, args) -> tuple[float, float, bool]:
    """(µs a step step by step, µs a step in one native call, whether both drafted the same)."""
    runner = PagedRunner(head.kv_layout(), dtype, max_requests=rows, max_context=args.context + args.steps + 8)
    if head.native_chain_parts(runner.kv) is None:
        raise SystemExit("this head has no native chain here (no kernels, a token map, another dtype)")
    ids, batch = runner.step([(b, [100 + (b + i) % 11 for i in range(args.context)]) for b in range(rows)])
    features = torch.randn(ids.shape[0], head.hidden_size, generator=torch.Generator().manual_seed(0))
    g = head(ids, features.to(dtype), batch)
    last = torch.arange(1, rows + 1) * args.context - 1
    hidden, first = g[last], head.compute_logits(g[last]).argmax(-1)
    chain = (first, hidden, torch.full((rows,), args.context), runner.req_to_slot, runner.kv, args.steps)
    keep = torch.ones(rows, dtype=torch.bool)
    native = lambda: head.draft_chain(*chain, keep, float("-inf"))[0]  # noqa: E731
    other = functools.partial(step_by_step, head, *chain) if args.against == "python" \
        else in_regions(native, head.kernels)
    return time_both(other, native, args.repeats, args.steps)


@torch.inference_mode()
def time_extends(head, rows: int, dtype: torch.dtype, args) -> tuple[float, float, bool]:
    """(µs an extend from Python, µs in one native call, whether both drafted the same): every row
    reads --steps + 1 verified tokens after its context, and its last one seeds the next chain."""
    per_row = args.steps + 1
    runner = PagedRunner(head.kv_layout(), dtype, max_requests=rows, max_context=args.context + per_row + 8)
    ids, batch = runner.step([(b, [100 + (b + i) % 11 for i in range(args.context)]) for b in range(rows)])
    noise = torch.Generator().manual_seed(0)
    head(ids, torch.randn(ids.shape[0], head.hidden_size, generator=noise).to(dtype), batch)
    ids, batch = runner.step([(b, [200 + (b + i) % 13 for i in range(per_row)]) for b in range(rows)])
    features = torch.randn(ids.shape[0], head.hidden_size, generator=noise).to(dtype)
    pick = torch.arange(1, rows + 1) * per_row - 1

    def from_python() -> torch.Tensor:
        return top_choice(head.compute_logits(head(ids, features, batch)[pick]), True, head.kernels)[0]

    native = lambda: head.extend_native(ids, features, batch, pick)[1]  # noqa: E731
    other = from_python if args.against == "python" else in_regions(native, head.kernels)
    return time_both(other, native, args.repeats)


def time_both(python, native, repeats: int, per: int = 1) -> tuple[float, float, bool]:
    """(median µs / per of python() (the other way), of native(), whether both gave the same drafts), the
    two alternating --repeats times (the first five of each left out)."""
    same = torch.equal(native(), python())
    times: dict[str, list[float]] = {"python": [], "native": []}
    for _ in range(repeats):
        for name, run in (("python", python), ("native", native)):
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e6 / per)
    return statistics.median(times["python"][5:]), statistics.median(times["native"][5:]), same


if __name__ == "__main__":
    main()
