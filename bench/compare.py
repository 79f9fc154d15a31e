"""Compare Tandem configurations on one workload: start each as a server, run the same
benchmark on each in alternating rounds, and print medians with ratios to the first.

    python bench/compare.py --config "overlap=" --config "no-overlap=--disable-overlap-schedule"
    python bench/compare.py --checkout HEAD~1 --config "none=--speculative-algorithm none"  # this tree against a commit
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402
from bench.paired import paired  # noqa: E402
from bench.worktree import (WORKING_TREE, CheckoutFailed, Tree, default_checkout_dir, mirror_files,  # noqa: E402
                            open_worktree, remove_worktree, resolve_revision)

REPO = serving.REPO
MODELS = REPO / "models"
HIDDEN_CPU_GAUGE = "tandem_hidden_cpu_fraction"
PHASE_COUNTER = "tandem_spec_phase_seconds_total"
DRAFT_PHASES = ("draft", "extend")            # device time the draft model costs a speculative step


# ---- source trees: the working tree, and a worktree of --checkout ------------------------

@contextmanager
def checkout(args) -> Iterator[Tree | None]:
    """The worktree of --checkout while the servers run (None without it); removed after unless --keep-checkout."""
    if not args.checkout:
        yield None
        return
    where = Path(args.checkout_dir or default_checkout_dir(args.short))
    reused = open_worktree(args.commit, where)
    try:
        # The same model files on both sides, so that only code differs (unless --checkout-models own).
        replaced = mirror_files(MODELS, where / "models") if args.checkout_models == "working" else []
        tree = Tree(where.resolve(), args.commit, args.short, tuple(replaced))
        models = "its own" if args.checkout_models == "own" else f"the working tree's ({len(replaced)} files differed)"
        print(f"{'reusing' if reused else 'made'} {tree.describe()} ({args.checkout}); models/: {models}", flush=True)
        yield tree
    finally:
        if not args.keep_checkout:
            remove_worktree(where)


# ---- server processes ------------------------------------------------------------

@dataclass(frozen=True)
class ServerSpec:
    """One server to start: a config's flags, run from one tree."""
    config: str
    flags: tuple[str, ...]
    tree: Tree

    @property
    def name(self) -> str:
        return self.config + self.tree.suffix


@dataclass
class Server:
    spec: ServerSpec
    port: int
    process: subprocess.Popen
    log_path: Path
    memory_mb: dict[str, float | None] = field(default_factory=dict)   # "started", "after the rounds"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def plan_servers(configs: list[tuple[str, list[str]]], trees: list[Tree]) -> list[ServerSpec]:
    """Every config once per tree, each config's servers side by side: [a@REV, a, b@REV, b, ...]."""
    return [ServerSpec(name, tuple(flags), tree) for name, flags in configs for tree in trees]


def parse_config(text: str) -> tuple[str, list[str]]:
    """"NAME=FLAGS" -> (NAME, [flags])."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--config wants NAME=FLAGS, got {text!r}")
    return name.strip(), shlex.split(flags)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args, spec: ServerSpec, port: int, common: list[str]) -> list[str]:
    """The tree's own server script; the model as the working tree names it, placed in the tree when it is one
    of models/ (the old revision then recognises its embedded model and finds its default draft heads)."""
    tree = spec.tree
    return [sys.executable, tree.place(args.server_script), "--port", str(port),
            "--model-path", tree.place(args.model_path, within=MODELS), *common, *spec.flags]


def server_env(tree: Tree) -> dict[str, str]:
    # The script's folder comes first on sys.path already; PYTHONPATH makes the tree's packages win in any
    # process it starts too, whatever PYTHONPATH we were given.
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.root), *([inherited] if inherited else [])])}


def start_server(args, spec: ServerSpec, common: list[str], log_dir: Path) -> Server:
    port = free_port()
    command = server_command(args, spec, port, common)
    env = server_env(spec.tree)
    log_path = log_dir / f"{spec.name}.log"
    with open(log_path, "w") as log:
        log.write(f"# {spec.name}: {spec.tree.describe()}\n# cwd {spec.tree.root}, PYTHONPATH {env['PYTHONPATH']}\n")
        log.write(" ".join(shlex.quote(c) for c in command) + "\n")
        log.flush()
        # A session of its own: Ctrl-C reaches only us, and we stop the server's whole group.
        process = subprocess.Popen(command, cwd=spec.tree.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(spec, port, process, log_path)


def answers_health(server: Server) -> bool:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_healthy(servers: list[Server], timeout: float) -> dict[str, str]:
    """Poll GET /health on every server until each answers 200; those that exit or time out instead, with why."""
    deadline = time.monotonic() + timeout
    waiting, failed = list(servers), {}
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                failed[server.name] = f"exited with status {server.process.returncode} before answering /health"
                waiting.remove(server)
            elif answers_health(server):
                waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            failed.update({s.name: f"not healthy after {timeout:g} s" for s in waiting})
            break
        if waiting:
            time.sleep(0.5)
    return {s.name: explain_start_failure(s, failed[s.name]) for s in servers if s.name in failed}


def explain_start_failure(server: Server, what: str) -> str:
    """Show the log's tail now; the one line kept for the summary and the JSON."""
    print(f"error: server {server.name!r} {what}; it is left out. Log {server.log_path}:\n{server.log_tail(8)}",
          file=sys.stderr, flush=True)
    return f"{what}: {last_line(server.log_tail())} (log {server.log_path})"


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def stop_servers(servers: list[Server], grace: float = 15.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after `grace` seconds."""
    for server in servers:
        if server.process.poll() is None:
            signal_group(server.process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for server in servers:
        try:
            server.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            signal_group(server.process, signal.SIGKILL)
            server.process.wait(10)
        signal_group(server.process, signal.SIGKILL)  # stray children of an exited server


def signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the group we created with start_new_session
    except (ProcessLookupError, PermissionError):
        pass


def scrape(url: str, name: str) -> dict[str, float]:
    """The samples of one Prometheus metric by label text ('' without labels); {} when absent."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode(errors="replace")
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            labels, _, value = line[len(name):].rpartition(" ")
            try:
                samples[labels.strip()] = float(value)
            except ValueError:
                pass
    return samples


def scrape_gauge(url: str, name: str) -> float | None:
    """Mean of a Prometheus gauge over its label sets, or None when absent."""
    values = list(scrape(url, name).values())
    return statistics.fmean(values) if values else None


def draft_share(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Share of a run's speculative device time spent in the draft model (draft + extend phases)."""
    spent = {labels: after[labels] - before.get(labels, 0.0) for labels in after}
    total = sum(spent.values())
    if total <= 0:
        return None
    return sum(v for labels, v in spent.items() if any(f'"{p}"' in labels for p in DRAFT_PHASES)) / total


# ---- rounds and the table ----------------------------------------------------------

def bench_namespace(args, url: str, concurrency: int) -> argparse.Namespace:
    """The serving.py arguments of one run: the workload flags plus this server and concurrency."""
    ns = argparse.Namespace(**vars(args))
    ns.base_url, ns.max_concurrency = url, concurrency
    ns.disable_tqdm, ns.output_file, ns.plot, ns.model = True, None, None, args.model
    return ns


def run_rounds(args, servers: list[Server]) -> list[dict]:
    """Every config once per round, in alternating order; one row per (config, concurrency)."""
    rows = {(s.name, c): {"config": s.name, "max_concurrency": c, "runs": []}
            for s in servers for c in args.max_concurrency}
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for server in order:
            for concurrency in args.max_concurrency:
                metrics = run_once(args, server, concurrency)
                rows[server.name, concurrency]["runs"].append(metrics)
                print(f"round {round_index + 1}/{args.rounds}  {server.name:<20} concurrency {concurrency:<4} "
                      f"{metrics['output_throughput']:8.1f} tok/s  "
                      f"decode {fmt(metrics['decode_throughput_per_request'], '.1f')} tok/s/req  "
                      f"TPOT {fmt(metrics['mean_tpot_ms'])} ms  {metrics['failed']} failed", flush=True)
    for row in rows.values():
        row["median"] = medians(row["runs"])
    return list(rows.values())


def run_once(args, server: Server, concurrency: int) -> dict:
    """One benchmark run on one server, with the server's gauges and its draft share over the run."""
    phases = scrape(server.url, PHASE_COUNTER)
    metrics = asyncio.run(serving.run_benchmark(bench_namespace(args, server.url, concurrency), verbose=False))
    metrics["hidden_cpu_fraction"] = scrape_gauge(server.url, HIDDEN_CPU_GAUGE)
    metrics["draft_share"] = draft_share(phases, scrape(server.url, PHASE_COUNTER))
    return metrics


def medians(runs: list[dict]) -> dict:
    """Per numeric metric, the median across runs (None when no run has it)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float, type(None))) and not isinstance(v, bool)]
    out = {}
    for key in keys:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if values else None
    out["failed_total"] = sum(r["failed"] for r in runs)
    return out


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def with_ratio(value, base) -> str:
    if value is None:
        return "n/a"
    ratio = f" ({value / base:.2f}x)" if base else ""
    return f"{value:.2f}{ratio}"


COLUMNS = [("output tok/s", "output_throughput"), ("decode tok/s/req", "decode_throughput_per_request"),
           ("mean TPOT ms", "mean_tpot_ms"),
           ("median TPOT ms", "median_tpot_ms"), ("mean TTFT ms", "mean_ttft_ms")]
AB_COLUMNS = [("output tok/s", "output_throughput"), ("decode tok/s/req", "decode_throughput_per_request"),
              ("median TTFT ms", "median_ttft_ms"), ("median ITL ms", "median_itl_ms")]


def name_width(names: list[str]) -> int:
    return max([16] + [len(n) + 2 for n in names])


def print_table(rows: list[dict], names: list[str], rounds: int) -> None:
    print(f"\nMedians over {rounds} round(s); ratios are to {names[0]!r}.")
    width = name_width(names)
    header = f"{'config':<{width}}{'conc':>5}" + "".join(f"{t:>20}" for t, _ in COLUMNS)
    header += f"{'accept len':>12}{'draft share':>13}{'hidden CPU':>12}{'failed':>8}"
    print(header)
    print("-" * len(header))
    for concurrency in sorted({r["max_concurrency"] for r in rows}):
        group = {r["config"]: r["median"] for r in rows if r["max_concurrency"] == concurrency}
        base = group[names[0]]
        for name in names:
            m = group[name]
            line = f"{name:<{width}}{concurrency:>5}" + "".join(f"{with_ratio(m[k], base[k]):>20}" for _, k in COLUMNS)
            line += (f"{fmt(m['accept_length']):>12}{fmt(m['draft_share']):>13}{fmt(m['hidden_cpu_fraction']):>12}"
                     f"{m['failed_total']:>8}")
            print(line)


# ---- the working tree against --checkout ------------------------------------------------

def ab_ratios(rows: list[dict], configs: list[str], suffix: str) -> list[dict]:
    """Per config and concurrency, the working tree's medians over those of the `NAME<suffix>` server
    ({metric: ratio}, None where a server or a value is missing), and its output tok/s paired round by
    round (bench/paired.py)."""
    medians_of = {(r["config"], r["max_concurrency"]): r["median"] for r in rows}
    runs_of = {(r["config"], r["max_concurrency"]): r.get("runs", []) for r in rows}
    concurrencies = sorted({c for _, c in medians_of})
    out = []
    for config in configs:
        for concurrency in concurrencies:
            new, old = (config, concurrency), (config + suffix, concurrency)
            pair = paired(runs_of.get(new, []), runs_of.get(old, []), "output_throughput")
            out.append({"config": config, "against": config + suffix, "max_concurrency": concurrency,
                        "ratios": {key: ratio(medians_of.get(new), medians_of.get(old), key) for _, key in AB_COLUMNS},
                        "paired_output": pair.record() if pair else None})
    return out


def paired_to_reference(rows: list[dict], configs: list[str], suffixes: list[str]) -> list[dict]:
    """Each config's output tok/s over the first config's from the same tree (a suffix: "" for the working
    tree, "@<short>" for --checkout's), round by round (bench/paired.py)."""
    runs_of = {(r["config"], r["max_concurrency"]): r.get("runs", []) for r in rows}
    out = []
    for concurrency in sorted({c for _, c in runs_of}):
        for suffix in suffixes:
            reference = configs[0] + suffix
            for name in (config + suffix for config in configs[1:]):
                pair = paired(runs_of.get((name, concurrency), []), runs_of.get((reference, concurrency), []),
                              "output_throughput")
                if pair:
                    out.append({"config": name, "against": reference, "max_concurrency": concurrency,
                                **pair.record()})
    return out


def print_paired(pairs: list[dict]) -> None:
    """The round-by-round ratios: their median and its interval."""
    if not pairs:
        return
    print("\nOutput tok/s, round by round (the two runs of a round are adjacent in time): median ratio "
          f"[{pairs[0]['level']:.0%} interval of the median]")
    width = name_width([p["config"] + " / " + p["against"] for p in pairs])
    for p in pairs:
        print(f"{p['config'] + ' / ' + p['against']:<{width}}{p['max_concurrency']:>5}   "
              f"{p['median']:.3f}x [{p['low']:.3f}, {p['high']:.3f}] over {p['rounds']} rounds")


def ratio(new: dict | None, old: dict | None, key: str) -> float | None:
    if not new or not old or new.get(key) is None or not old.get(key):
        return None
    return new[key] / old[key]


def ab_cell(new: dict | None, old: dict | None, key: str) -> str:
    """'old -> new (ratio)' for one metric."""
    if not new or not old:
        return "not measured"
    r = ratio(new, old, key)
    return f"{fmt(old[key], '.1f')} -> {fmt(new[key], '.1f')} ({fmt(r)}x)" if r is not None else \
        f"{fmt(old[key], '.1f')} -> {fmt(new[key], '.1f')}"


def print_ab_table(rows: list[dict], ab: list[dict], short: str) -> None:
    medians_of = {(r["config"], r["max_concurrency"]): r["median"] for r in rows}
    print(f"\nWorking tree against {short}: medians at {short} -> in the working tree (ratio); "
          "tok/s: higher is faster, ms: lower is faster.")
    width = name_width([e["config"] for e in ab])
    header = f"{'config':<{width}}{'conc':>5}" + "".join(f"{t:>28}" for t, _ in AB_COLUMNS)
    print(header)
    print("-" * len(header))
    for entry in sorted(ab, key=lambda e: e["max_concurrency"]):
        new = medians_of.get((entry["config"], entry["max_concurrency"]))
        old = medians_of.get((entry["against"], entry["max_concurrency"]))
        print(f"{entry['config']:<{width}}{entry['max_concurrency']:>5}"
              + "".join(f"{ab_cell(new, old, key):>28}" for _, key in AB_COLUMNS))


# ---- arguments and main --------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", action="append", type=parse_config, required=True, metavar="NAME=FLAGS",
                        help="A configuration: a name and extra run.py flags (repeat; the first is the reference).")
    parser.add_argument("--model-path", default=str(MODELS / "tandem-dense"), help="Passed to every server.")
    parser.add_argument("--server-args", default="", help="Extra run.py flags for every server.")
    parser.add_argument("--server-script", default=str(REPO / "run.py"), help="The server entry point.")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="Seconds to wait for /health.")
    parser.add_argument("--rounds", type=int, default=2, help="Each round runs every config once, order alternating.")
    parser.add_argument("--max-concurrency", default="1,16", help="Comma-separated concurrencies; each is a run.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every run and the medians.")
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a new temporary folder).")
    ab = parser.add_argument_group("the working tree against a commit")
    ab.add_argument("--checkout", metavar="REV", default=None,
                    help="Also run every config from a git worktree of REV (commit, tag or branch) as NAME@<short "
                         "hash>, in the same rounds, and report the working tree's ratios to it.")
    ab.add_argument("--checkout-dir", default=None,
                    help="Where the worktree goes (default: <temp dir>/tandem-checkout-<short hash>); reused when "
                         "it already is an unedited worktree at REV.")
    ab.add_argument("--keep-checkout", action="store_true", help="Leave the worktree there at the end.")
    ab.add_argument("--checkout-models", choices=["working", "own"], default="working",
                    help="Model files of REV's servers: working: the working tree's models/ copied over REV's, "
                         "so that only code differs; own: REV's own.")
    serving.add_client_args(parser)
    serving.add_workload_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkout:
        try:
            args.commit, args.short = resolve_revision(args.checkout)
        except CheckoutFailed as exc:
            parser.error(str(exc))
    elif args.checkout_dir or args.keep_checkout:
        parser.error("--checkout-dir and --keep-checkout go with --checkout")
    suffixes = [f"@{args.short}", ""] if args.checkout else [""]
    names = [name + suffix for name, _ in args.config for suffix in suffixes]
    if len(set(names)) != len(names):
        parser.error("config names must differ")
    check_run_args(parser, args)
    return args


def check_run_args(parser: argparse.ArgumentParser, args) -> None:
    """What every tool that runs rounds of serving.py on Tandem servers checks (this one,
    baseline_llamacpp.py): --max-concurrency made a list, --rounds, the server script, the workload."""
    try:
        args.max_concurrency = [int(c) for c in args.max_concurrency.split(",") if c.strip()]
        if not args.max_concurrency or min(args.max_concurrency) < 1:
            raise ValueError
    except ValueError:
        parser.error("--max-concurrency wants positive integers, e.g. 1,16")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not Path(args.server_script).is_file():
        parser.error(f"server script {args.server_script} not found")
    args.tokenizer = args.tokenizer or args.model_path
    try:
        serving.finish_args(bench_namespace(args, "http://127.0.0.1", args.max_concurrency[0]))
    except ValueError as exc:
        parser.error(str(exc))


def common_flags(args, servers: int) -> list[str]:
    """--server-args, plus a share of device memory per server unless a flag sets it."""
    common = shlex.split(args.server_args)
    everything = common + [f for _, flags in args.config for f in flags]
    if servers > 1 and not any(f.startswith("--mem-fraction-static") for f in everything):
        common += ["--mem-fraction-static", f"{0.85 / servers:.2f}"]
    return common


def measure(args, specs: list[ServerSpec], log_dir: Path) -> tuple[list[Server], dict[str, str], list[dict]]:
    """Start every server, run the rounds on those that answer /health, stop them all: (servers, failed, rows).

    A server that does not start (a flag its revision lacks, say) is reported and left out; the others run."""
    servers: list[Server] = []
    try:
        common = common_flags(args, len(specs))
        for spec in specs:
            servers.append(start_server(args, spec, common, log_dir))
        print(f"started {len(servers)} servers (logs in {log_dir}); waiting for /health", flush=True)
        failed = wait_healthy(servers, args.health_timeout)
        stop_servers([s for s in servers if s.name in failed])      # one that timed out may still run
        healthy = [s for s in servers if s.name not in failed]
        note_memory(healthy, "started")
        rows = run_rounds(args, healthy) if healthy else []
        note_memory(healthy, "after the rounds")
        return servers, failed, rows
    finally:
        stop_servers(servers)


def note_memory(servers: list[Server], when: str) -> None:
    for server in servers:
        server.memory_mb[when] = resident_mb(server.process.pid)


def resident_mb(pid: int) -> float | None:
    """Proportional set size (shared pages split between the processes that map them) of a process and
    all its descendants: the front and its ranks together, as the machine pays for them."""
    total, found = 0, False
    for process in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{process}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    found = True
        except OSError:
            continue
    return total / 1024 if found else None


def descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [grand for child in children for grand in [child, *descendants(child)]]


def print_memory(servers: list[Server]) -> None:
    print("\nResident memory (PSS of the front and its ranks), MB:")
    for server in servers:
        cells = ", ".join(f"{when} {fmt(mb, '.0f')}" for when, mb in server.memory_mb.items())
        if cells:
            print(f"  {server.name:<{name_width([s.name for s in servers])}} {cells}")


def write_record(args, servers: list[Server], failed: dict[str, str], rows: list[dict], tree: Tree | None,
                 ab: list[dict] | None, pairs: list[dict]) -> None:
    workload = {k: v for k, v in serving.args_record(args).items() if k != "config"}
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "configs": [{"name": n, "flags": f} for n, f in args.config], "rounds": args.rounds,
              "workload": workload,
              "servers": [{"name": s.name, "config": s.spec.config, "flags": list(s.spec.flags),
                           "tree": str(s.spec.tree.root), "commit": s.spec.tree.commit,
                           "memory_mb": s.memory_mb} for s in servers],
              "failed_servers": failed, "results": rows, "paired_output": pairs,
              "server_pids": [s.process.pid for s in servers]}
    if tree:
        record["checkout"] = {"rev": args.checkout, "commit": tree.commit, "short": tree.short,
                              "path": str(tree.root), "kept": args.keep_checkout, "models": args.checkout_models,
                              "models_replaced": list(tree.models_replaced)}
        record["ab"] = ab
    with open(args.output_file, "a") as f:
        f.write(json.dumps(serving.jsonable(record)) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: servers, then the worktree
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with checkout(args) as old_tree:
            trees = [old_tree, WORKING_TREE] if old_tree else [WORKING_TREE]
            servers, failed, rows = measure(args, plan_servers(args.config, trees), log_dir)
    except CheckoutFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    if not rows:
        print("error: no server answered /health; nothing measured", file=sys.stderr)
        return 1
    names = [s.name for s in servers if s.name not in failed]
    print_table(rows, names, args.rounds)
    configs = [name for name, _ in args.config]
    pairs = paired_to_reference(rows, configs, ["", old_tree.suffix] if old_tree else [""])
    ab = ab_ratios(rows, configs, old_tree.suffix) if old_tree else None
    if ab:
        print_ab_table(rows, ab, old_tree.short)
        pairs += [{"config": e["config"], "against": e["against"], "max_concurrency": e["max_concurrency"],
                   **e["paired_output"]} for e in ab if e["paired_output"]]
    print_paired(pairs)
    print_memory(servers)
    for name, why in failed.items():
        print(f"not measured: {name} {why}")
    if args.output_file:
        write_record(args, servers, failed, rows, old_tree, ab, pairs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
