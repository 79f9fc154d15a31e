"""Prefill/decode disaggregation against the unified server, on the workload PD is for: long prompts
arriving while other requests decode.

    python bench/pd_compare.py --rounds 3 --output-file pd.jsonl
    python bench/pd_compare.py --server-args "--speculative-algorithm none" --setups unified,pd-pinned

Starts every setup at once (a unified server, or a prefill node and a decode node; pinned to cores with
taskset where the setup says), then in alternating rounds runs the same two request classes at the same
time on each: short prompts with long outputs that decode throughout, and long prompts arriving now and
then while they decode. Prints TTFT, inter-token latency and output tok/s per class side by side, and the
pair's transfer counters; --output-file appends one JSON line with every run and the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import compare, serving  # noqa: E402
from bench.worktree import WORKING_TREE  # noqa: E402

REPO = compare.REPO
CLASSES = ("short", "long")
WARM_UP_TOKENS = 8


# ---- setups: which nodes, where they run ----------------------------------------------

@dataclass(frozen=True)
class Node:
    role: str                   # unified | prefill | decode
    cores: str | None           # taskset -c list; None: wherever the OS puts it
    threads: int                # --cpu-threads of its rank


@dataclass(frozen=True)
class Setup:
    name: str
    about: str
    nodes: tuple[Node, ...]     # one unified node, or a prefill node then a decode node

    @property
    def is_pd(self) -> bool:
        return len(self.nodes) == 2


def all_setups(cores: list[int], threads: int) -> dict[str, Setup]:
    """The setups, by name: `cores` are the CPUs the pinned ones use (pd-pinned needs two), `threads` the
    rank threads of the unpinned ones that take the whole machine."""
    first, second = str(cores[0]), str(cores[-1])
    setups = [
        Setup("unified", f"one node, {threads} threads, unpinned", (Node("unified", None, threads),)),
        Setup("unified-1core", f"one node on core {first}, 1 thread", (Node("unified", first, 1),)),
        Setup("pd-pinned", f"prefill on core {second}, decode on core {first}, 1 thread each",
              (Node("prefill", second, 1), Node("decode", first, 1))),
        Setup("pd-shared", "prefill and decode unpinned, 1 thread each",
              (Node("prefill", None, 1), Node("decode", None, 1))),
        Setup("pd-default", f"prefill and decode unpinned, {threads} threads each (run.py's default here)",
              (Node("prefill", None, threads), Node("decode", None, threads))),
    ]
    return {s.name: s for s in setups if s.name != "pd-pinned" or first != second}


DEFAULT_SETUPS = "unified,unified-1core,pd-pinned,pd-shared"   # pd-default: 4 threads on 2 cores, slow


# ---- starting and stopping the nodes ----------------------------------------------------

@dataclass
class Deployment:
    """A setup's running servers: the node clients talk to, and the prefill node of a pair."""
    setup: Setup
    servers: list[compare.Server]

    @property
    def entry(self) -> compare.Server:
        return self.servers[-1]

    @property
    def prefill(self) -> compare.Server | None:
        return self.servers[0] if self.setup.is_pd else None


def node_flags(node: Node, bootstrap_port: int) -> list[str]:
    """run.py flags of one node of a setup (its role, the pair's bootstrap port, its threads)."""
    role = {"unified": [],
            "prefill": ["--role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port)],
            "decode": ["--role", "decode", "--prefill-addr", f"127.0.0.1:{bootstrap_port}"]}[node.role]
    return [*role, "--cpu-threads", str(node.threads)]


def start_node(args, setup: Setup, node: Node, bootstrap_port: int, log_dir: Path) -> compare.Server:
    """compare.py's server command, under `taskset -c CORES` when the node is pinned (its ranks inherit it)."""
    name = setup.name if node.role == "unified" else f"{setup.name}/{node.role}"
    spec = compare.ServerSpec(name, tuple(node_flags(node, bootstrap_port)), WORKING_TREE)
    port = compare.free_port()
    command = (["taskset", "-c", node.cores] if node.cores else []) + compare.server_command(
        args, spec, port, shlex.split(args.server_args))
    log_path = log_dir / f"{name.replace('/', '-')}.log"
    with open(log_path, "w") as log:
        log.write(" ".join(shlex.quote(c) for c in command) + "\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=compare.server_env(WORKING_TREE), stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return compare.Server(spec, port, process, log_path)


def deploy(args, setups: list[Setup], log_dir: Path, started: list[compare.Server]) -> tuple[list[Deployment], dict]:
    """Start every setup: unified and prefill nodes first, decode nodes once their prefill node answers.
    Every server goes into `started` (for the caller to stop); a setup with a node that failed is left out."""
    ports = {s.name: compare.free_port() for s in setups}
    first = {s.name: start_node(args, s, s.nodes[0], ports[s.name], log_dir) for s in setups}
    started.extend(first.values())
    failed = compare.wait_healthy(list(first.values()), args.health_timeout)
    decode = {s.name: start_node(args, s, s.nodes[1], ports[s.name], log_dir)
              for s in setups if s.is_pd and first[s.name].name not in failed}
    started.extend(decode.values())
    failed |= compare.wait_healthy(list(decode.values()), args.health_timeout)
    deployments, failed_setups = [], {}
    for setup in setups:
        servers = [first[setup.name]] + ([decode[setup.name]] if setup.name in decode else [])
        why = [f"{s.name}: {failed[s.name]}" for s in servers if s.name in failed]
        if why or len(servers) != len(setup.nodes):
            failed_setups[setup.name] = "; ".join(why) or "its prefill node did not start"
        else:
            deployments.append(Deployment(setup, servers))
    compare.stop_servers([s for s in started if s.name in failed])
    return deployments, failed_setups


# ---- the workload: two classes at once ---------------------------------------------------

def class_argv(args, name: str, url: str) -> list[str]:
    """bench/serving.py flags of one request class against `url`."""
    common = ["--base-url", url, "--tokenizer", args.tokenizer, "--dataset-name", args.dataset_name,
              "--warmup-requests", "0", "--disable-tqdm", "--timeout", str(args.timeout)]
    common += ["--dataset-path", args.dataset_path] if args.dataset_path else []
    if name == "short":
        return common + ["--num-prompts", str(args.short_prompts), "--random-input-len", str(args.short_input_len),
                         "--random-output-len", str(args.short_output_len), "--random-range-ratio",
                         str(args.short_range_ratio), "--max-concurrency", str(args.short_concurrency),
                         "--seed", str(args.seed)]
    return common + ["--num-prompts", str(args.long_prompts), "--random-input-len", str(args.long_input_len),
                     "--random-output-len", str(args.long_output_len), "--random-range-ratio",
                     str(args.long_range_ratio), "--request-rate", str(1.0 / args.long_interval),
                     "--seed", str(args.seed + 1)]


def class_args(args, name: str, url: str) -> argparse.Namespace:
    return serving.parse_args(class_argv(args, name, url))


def build_workload(args) -> dict[str, list[serving.Request]]:
    """Both classes' requests, made once: every setup and round gets the same prompts."""
    tokenizer = serving.load_tokenizer(args.tokenizer)
    return {name: serving.build_requests(class_args(args, name, "http://127.0.0.1"), tokenizer) for name in CLASSES}


async def after(delay: float, coroutine):
    await asyncio.sleep(delay)
    return await coroutine


async def run_mixed(args, deployment: Deployment, workload: dict[str, list[serving.Request]]) -> dict:
    """One run: the short class from the start, the long class from --long-start-delay, with the pair's
    counters around it."""
    url = deployment.entry.url
    async with aiohttp.ClientSession() as session:
        before = await pd_counters(session, deployment)
        start = time.perf_counter()
        short, long = await asyncio.gather(
            serving.run_benchmark(class_args(args, "short", url), verbose=False, requests=workload["short"]),
            after(args.long_start_delay,
                  serving.run_benchmark(class_args(args, "long", url), verbose=False, requests=workload["long"])))
        wall = time.perf_counter() - start
        after_run = await pd_counters(session, deployment)
    run = {"short": short, "long": long, "wall_s": wall,
           "output_throughput": (short["total_output_tokens"] + long["total_output_tokens"]) / wall,
           # the case under test needs the long prompts to arrive and finish while the short ones decode
           "long_within_short": args.long_start_delay + long["duration"] <= short["duration"]}
    if before is not None:
        run["pd"] = serving.pd_report(before, after_run, {"mean_ttft_ms": mean_ttft_ms(short, long)})
    return run


async def pd_counters(session: aiohttp.ClientSession, deployment: Deployment) -> dict | None:
    if deployment.prefill is None:
        return None
    return {"prefill": await serving.scrape_pd(session, deployment.prefill.url),
            "decode": await serving.scrape_pd(session, deployment.entry.url)}


def mean_ttft_ms(*metrics: dict) -> float | None:
    """Mean TTFT over the requests of several runs."""
    counted = [(m["mean_ttft_ms"], m["completed"]) for m in metrics if m["mean_ttft_ms"] is not None]
    total = sum(n for _, n in counted)
    return sum(v * n for v, n in counted) / total if total else None


async def warm_up(args, deployment: Deployment, workload: dict[str, list[serving.Request]]) -> None:
    """One short request of each class, so that first-call costs fall outside the rounds."""
    for name in CLASSES:
        first = workload[name][0]
        request = replace(first, output_len=min(first.output_len, WARM_UP_TOKENS))
        await serving.run_benchmark(class_args(args, name, deployment.entry.url), verbose=False, requests=[request])


# ---- rounds, medians, the tables ------------------------------------------------------------

def run_rounds(args, deployments: list[Deployment], workload: dict) -> list[dict]:
    rows = [{"setup": d.setup.name, "about": d.setup.about, "runs": []} for d in deployments]
    for deployment in deployments:
        asyncio.run(warm_up(args, deployment, workload))
    for round_index in range(args.rounds):
        order = list(zip(deployments, rows))
        for deployment, row in order if round_index % 2 == 0 else order[::-1]:
            run = asyncio.run(run_mixed(args, deployment, workload))
            row["runs"].append(run)
            print_progress(round_index, args.rounds, deployment.setup.name, run)
    for row in rows:
        row["median"] = run_medians(row["runs"])
    return rows


def print_progress(round_index: int, rounds: int, name: str, run: dict) -> None:
    short, long = run["short"], run["long"]
    print(f"round {round_index + 1}/{rounds}  {name:<14} short: ITL p99 {compare.fmt(short['p99_itl_ms'])} ms, "
          f"{short['output_throughput']:.1f} tok/s; long: TTFT median {compare.fmt(long['median_ttft_ms'])} ms; "
          f"{short['failed'] + long['failed']} failed"
          + ("" if run["long_within_short"] else "  (the long class outlasted the short one)"), flush=True)


def run_medians(runs: list[dict]) -> dict:
    """Per class, compare.py's medians of every metric; the pair's per-room figures and counters likewise."""
    out = {name: compare.medians([r[name] for r in runs]) for name in CLASSES}
    out["output_throughput"] = statistics.median(r["output_throughput"] for r in runs)
    out["long_within_short"] = sum(r["long_within_short"] for r in runs)
    if "pd" in runs[0]:
        out["pd"] = compare.medians([pd_flat(r["pd"]) for r in runs])
    return out


def pd_flat(pd: dict) -> dict:
    """A run's PD report as one level of numbers (per room, then each node's counters)."""
    flat = {k: v for k, v in pd.items() if k not in ("prefill", "decode")}
    for node in ("prefill", "decode"):
        counters = pd[node] or {}
        flat |= {f"{node}_{k}": v for k, v in counters.items() if k != "failures"}
    flat["failed"] = (pd["decode"] or {}).get("rooms_failed", 0)    # compare.medians sums "failed" over runs
    return flat


LATENCY_COLUMNS = [("TTFT med ms", "median_ttft_ms"), ("TTFT p99 ms", "p99_ttft_ms"),
                   ("ITL med ms", "median_itl_ms"), ("ITL p99 ms", "p99_itl_ms"), ("out tok/s", "output_throughput")]
PD_COLUMNS = [("KV MB/room", "bytes_per_room", 1e-6, ".3f"), ("decode room ms", "decode_room_ms", 1.0, ".1f"),
              ("prefill room ms", "prefill_room_ms", 1.0, ".1f"), ("hand-off ms", "handoff_ms", 1.0, ".2f"),
              ("room/TTFT", "room_share_of_ttft", 1.0, ".2f"), ("hand-off/TTFT", "handoff_share_of_ttft", 1.0, ".3f")]


def print_tables(args, rows: list[dict]) -> None:
    print(f"\nMedians over {args.rounds} round(s). {workload_text(args)}")
    width = compare.name_width([r["setup"] for r in rows])
    header = f"{'setup':<{width}}{'class':<7}" + "".join(f"{t:>14}" for t, _ in LATENCY_COLUMNS)
    header += f"{'all tok/s':>11}{'failed':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        for name in CLASSES:
            m = row["median"][name]
            total = compare.fmt(row["median"]["output_throughput"], ".1f") if name == "short" else ""
            print(f"{row['setup'] if name == 'short' else '':<{width}}{name:<7}"
                  + "".join(f"{compare.fmt(m[k], '.1f'):>14}" for _, k in LATENCY_COLUMNS)
                  + f"{total:>11}{m['failed_total']:>8}")
    pd_rows = [r for r in rows if "pd" in r["median"]]
    if pd_rows:
        print_pd_table(pd_rows, width)


def print_pd_table(rows: list[dict], width: int) -> None:
    print("\nThe pairs' transfers (decode node's counters; a room is one request's prefill and KV hand-off):")
    header = f"{'setup':<{width}}{'rooms':>7}" + "".join(f"{t:>16}" for t, *_ in PD_COLUMNS) + f"{'failed':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        pd = row["median"]["pd"]
        rooms = (pd.get("decode_rooms_done") or 0) + (pd.get("decode_rooms_failed") or 0)
        cells = "".join(f"{compare.fmt(None if pd[k] is None else pd[k] * scale, spec):>16}"
                        for _, k, scale, spec in PD_COLUMNS)
        print(f"{row['setup']:<{width}}{rooms:>7.0f}{cells}{pd['failed_total']:>8.0f}")


def workload_text(args) -> str:
    low = max(int(args.short_input_len * args.short_range_ratio), 1)
    out_low = max(int(args.short_output_len * args.short_range_ratio), 1)
    long_low = max(int(args.long_input_len * args.long_range_ratio), 1)
    long_out_low = max(int(args.long_output_len * args.long_range_ratio), 1)
    return (f"short: {args.short_prompts} prompts of {low}-{args.short_input_len} tokens, {out_low}-"
            f"{args.short_output_len} out, {args.short_concurrency} at once; long: {args.long_prompts} prompts of "
            f"{long_low}-{args.long_input_len} tokens, {long_out_low}-{args.long_output_len} out, one every "
            f"{args.long_interval:g} s on average (Poisson) from {args.long_start_delay:g} s in.")


# ---- arguments and main ---------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--setups", default=DEFAULT_SETUPS,
                        help="Comma list of unified, unified-1core, pd-pinned, pd-shared, pd-default "
                             "(bench/README.md).")
    parser.add_argument("--cores", default=None,
                        help="CPUs the pinned setups use, e.g. 0,1 (default: the first two this process may use).")
    parser.add_argument("--model-path", default=str(compare.MODELS / "tandem-dense"), help="Every node's model.")
    parser.add_argument("--server-args", default="",
                        help="Extra run.py flags for every node, e.g. the speculation (both halves of a pair must "
                             "agree on it).")
    parser.add_argument("--server-script", default=str(REPO / "run.py"), help="The server entry point.")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="Seconds to wait for /health.")
    parser.add_argument("--rounds", type=int, default=3, help="Each round runs every setup once, order alternating.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every run and the medians.")
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a new temporary folder).")
    add_workload_args(parser)
    return parser


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("the workload (prompts as bench/serving.py makes them)")
    work.add_argument("--dataset-name", choices=("code", "random"), default="code")
    work.add_argument("--dataset-path", default=None, help="Source folder for `code` (default: the stdlib).")
    work.add_argument("--tokenizer", default=None, help="Tokenizer folder (default: --model-path).")
    work.add_argument("--seed", type=int, default=1, help="Seed of the short class (the long one uses seed + 1).")
    work.add_argument("--timeout", type=float, default=600.0, help="Seconds one request may take.")
    work.add_argument("--short-prompts", type=int, default=64, help="Short requests.")
    work.add_argument("--short-input-len", type=int, default=64, help="Most prompt tokens of a short request.")
    work.add_argument("--short-output-len", type=int, default=256, help="Most output tokens of a short request.")
    work.add_argument("--short-range-ratio", type=float, default=0.75, help="Short lengths: [len * ratio, len].")
    work.add_argument("--short-concurrency", type=int, default=8, help="Short requests in flight at once.")
    work.add_argument("--long-prompts", type=int, default=6, help="Long requests.")
    work.add_argument("--long-input-len", type=int, default=1500, help="Most prompt tokens of a long request.")
    work.add_argument("--long-output-len", type=int, default=16, help="Most output tokens of a long request.")
    work.add_argument("--long-range-ratio", type=float, default=0.67, help="Long lengths: [len * ratio, len].")
    work.add_argument("--long-interval", type=float, default=1.0,
                      help="Mean seconds between long arrivals (Poisson, the same times on every setup).")
    work.add_argument("--long-start-delay", type=float, default=1.0,
                      help="Seconds after the short class starts that the first long request is sent.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.tokenizer = args.tokenizer or args.model_path
    try:
        args.setups = pick_setups(args)
        check_workload(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def pick_setups(args) -> list[Setup]:
    allowed = sorted(os.sched_getaffinity(0))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else allowed[:2]
    if not cores or not set(cores) <= set(allowed):
        raise ValueError(f"--cores must be among the CPUs this process may use: {allowed}")
    known = all_setups(cores, len(allowed))
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--setups wants distinct names among {', '.join(known)} (got {args.setups!r}; "
                         "pd-pinned needs two cores)")
    return [known[n] for n in names]


def check_workload(args) -> None:
    if args.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    if args.long_interval <= 0 or args.long_start_delay < 0:
        raise ValueError("--long-interval must be positive and --long-start-delay not negative")
    if not Path(args.server_script).is_file():
        raise ValueError(f"server script {args.server_script} not found")
    for name in CLASSES:       # serving.py's own checks, as errors of this tool
        ns = serving.build_parser().parse_args(class_argv(args, name, "http://127.0.0.1"))
        serving.finish_args(ns)


def write_record(args, rows: list[dict], failed: dict[str, str], servers: list[compare.Server]) -> None:
    workload = {k: v for k, v in vars(args).items() if k.startswith(("short_", "long_", "dataset_", "seed"))}
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "server_args": args.server_args,
              "model_path": args.model_path, "rounds": args.rounds, "workload": workload,
              "workload_text": workload_text(args),
              "setups": [{"name": s.name, "about": s.about, "nodes": [vars(n) for n in s.nodes]} for s in args.setups],
              "commands": {s.name: s.log_path.read_text().splitlines()[0] for s in servers if s.log_path.exists()},
              "failed_setups": failed, "results": rows}
    with open(args.output_file, "a") as f:
        f.write(json.dumps(serving.jsonable(record)) + "\n")


def measure(args, log_dir: Path) -> tuple[list[dict], dict[str, str], list[compare.Server]]:
    workload = build_workload(args)
    started: list[compare.Server] = []
    try:
        print(f"starting {len(args.setups)} setups (logs in {log_dir}); waiting for /health", flush=True)
        deployments, failed = deploy(args, args.setups, log_dir, started)
        for name, why in failed.items():
            print(f"error: setup {name!r} did not start: {why}", file=sys.stderr, flush=True)
        return (run_rounds(args, deployments, workload) if deployments else []), failed, started
    finally:
        compare.stop_servers(started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the servers
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-pd-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        rows, failed, servers = measure(args, log_dir)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    if not rows:
        print("error: no setup started; nothing measured", file=sys.stderr)
        return 1
    print_tables(args, rows)
    if any(r["median"]["long_within_short"] < len(r["runs"]) for r in rows):
        print("note: in some runs the long class outlasted the short one (more --short-prompts keeps them decoding)")
    for name, why in failed.items():
        print(f"not measured: {name}: {why}")
    if args.output_file:
        write_record(args, rows, failed, servers)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
