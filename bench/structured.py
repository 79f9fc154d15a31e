"""What structured outputs cost, side by side: on each server config, in alternating rounds, the same
workload three ways: no request constrained (free), one request in ONE_IN constrained (one: at 16
requests at a time, about one constrained request in every batch), every request constrained (all).
Prints medians of the free and the constrained streams' decode speed with ratios to the free run's:
what a constrained request costs the unconstrained ones beside it, and what constrained decoding costs
itself, with and without speculation.

    python bench/structured.py --config "none=--speculative-algorithm none" --config "default=" \\
        --dataset-name random --random-input-len 24 --random-range-ratio 1.0 --random-output-len 128 \\
        --num-prompts 64 --max-concurrency 1,16 --rounds 5

The constraint is --constraint (default: a regex of lowercase words that never ends before the length
limit, so constrained and free streams emit as many tokens).
"""
from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import compare, serving  # noqa: E402
from bench.worktree import WORKING_TREE  # noqa: E402

ONE_IN = 16
FREE, CONSTRAINED = "free_decode_throughput_per_request", "constrained_decode_throughput_per_request"


def workloads(args) -> list[tuple[str, float]]:
    return [("free", 0.0), ("one", 1.0 / ONE_IN), ("all", 1.0)]


def run_rounds(args, servers: list[compare.Server]) -> dict[tuple[str, int, str], list[dict]]:
    """Every server, concurrency and workload once a round, servers and workloads in alternating order."""
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for server in servers if round_index % 2 == 0 else servers[::-1]:
            for concurrency in args.max_concurrency:
                order = workloads(args) if round_index % 2 == 0 else workloads(args)[::-1]   # no order bias
                for workload, share in order:
                    bench = compare.bench_namespace(args, server.url, concurrency)
                    bench.constrained_fraction = share
                    metrics = asyncio.run(serving.run_benchmark(bench, verbose=False))
                    runs.setdefault((server.name, concurrency, workload), []).append(metrics)
                    print(f"round {round_index + 1}/{args.rounds}  {server.name:<12} c={concurrency:<3} {workload:<5}"
                          f" free {compare.fmt(metrics[FREE], '.1f')} tok/s/req  constrained "
                          f"{compare.fmt(metrics[CONSTRAINED], '.1f')} tok/s/req  {metrics['failed']} failed",
                          flush=True)
    return runs


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def table(runs: dict[tuple[str, int, str], list[dict]]) -> list[dict]:
    """Per server and concurrency: the free run's speed, and each other run's against it."""
    rows = []
    for name, concurrency in dict.fromkeys((n, c) for n, c, _ in runs):
        free = median(runs[name, concurrency, "free"], FREE)
        row = {"config": name, "max_concurrency": concurrency, "free": free,
               "one_free": median(runs[name, concurrency, "one"], FREE),
               "one_constrained": median(runs[name, concurrency, "one"], CONSTRAINED),
               "all_constrained": median(runs[name, concurrency, "all"], CONSTRAINED),
               "failed": sum(r["failed"] for w in ("free", "one", "all") for r in runs[name, concurrency, w])}
        rows.append(row)
    return rows


def print_table(rows: list[dict], rounds: int) -> None:
    print(f"\nDecode tok/s per stream, medians over {rounds} round(s); ratios to the same config's free run.")
    header = (f"{'config':<14}{'conc':>5}{'free run':>12}{'one: free streams':>22}{'one: constrained':>20}"
              f"{'all constrained':>20}{'failed':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        base = row["free"]
        cells = [compare.with_ratio(row[key], base) for key in ("one_free", "one_constrained", "all_constrained")]
        print(f"{row['config']:<14}{row['max_concurrency']:>5}{compare.fmt(base, '.1f'):>12}{cells[0]:>22}"
              f"{cells[1]:>20}{cells[2]:>20}{row['failed']:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = compare.build_parser()
    args = parser.parse_args(argv)
    compare.check_run_args(parser, args)
    args.checkout = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-structured-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = compare.plan_servers(args.config, [WORKING_TREE])
    servers = [compare.start_server(args, spec, compare.common_flags(args, len(specs)), log_dir) for spec in specs]
    try:
        failed = compare.wait_healthy(servers, args.health_timeout)
        if failed:
            print(f"error: not started: {failed}", file=sys.stderr)
            return 1
        runs = run_rounds(args, servers)
    finally:
        compare.stop_servers(servers)
    rows = table(runs)
    print_table(rows, args.rounds)
    if args.output_file:
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows, "constraint": args.constraint,
                  "configs": dict(args.config), "argv": sys.argv[1:]}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
