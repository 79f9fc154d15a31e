"""Compare Tandem configurations on one workload: start each as a server, run the same
benchmark on each in alternating rounds, and print medians with ratios to the first.

    python bench/compare.py --config "overlap=" --config "no-overlap=--disable-overlap-schedule"
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
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402

REPO = serving.REPO
HIDDEN_CPU_GAUGE = "tandem_hidden_cpu_fraction"
PHASE_COUNTER = "tandem_spec_phase_seconds_total"
DRAFT_PHASES = ("draft", "extend")            # device time the draft model costs a speculative step


class ServerFailed(RuntimeError):
    """A server exited or never answered /health."""


@dataclass
class Server:
    name: str
    flags: list[str]
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# ---- server processes ------------------------------------------------------------

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


def start_server(args, name: str, flags: list[str], common: list[str], log_dir: Path) -> Server:
    port = free_port()
    command = [sys.executable, args.server_script, "--port", str(port), "--model-path", args.model_path,
               *common, *flags]
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        log.write(" ".join(shlex.quote(c) for c in command) + "\n")
        log.flush()
        # A session of its own: Ctrl-C reaches only us, and we stop the server's whole group.
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(name, flags, port, process, log_path)


def wait_healthy(servers: list[Server], timeout: float) -> None:
    """Poll GET /health on every server until each answers 200."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                raise ServerFailed(f"server {server.name!r} exited with status {server.process.returncode}; "
                                   f"log {server.log_path}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        waiting.remove(server)
            except OSError:
                pass
        if waiting and time.monotonic() > deadline:
            names = ", ".join(repr(s.name) for s in waiting)
            raise ServerFailed(f"server {names} not healthy after {timeout:g} s; "
                               f"log {waiting[0].log_path}:\n{waiting[0].log_tail()}")
        if waiting:
            time.sleep(0.5)


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
                phases = scrape(server.url, PHASE_COUNTER)
                metrics = asyncio.run(serving.run_benchmark(bench_namespace(args, server.url, concurrency), verbose=False))
                metrics["hidden_cpu_fraction"] = scrape_gauge(server.url, HIDDEN_CPU_GAUGE)
                metrics["draft_share"] = draft_share(phases, scrape(server.url, PHASE_COUNTER))
                rows[server.name, concurrency]["runs"].append(metrics)
                print(f"round {round_index + 1}/{args.rounds}  {server.name:<16} concurrency {concurrency:<4} "
                      f"{metrics['output_throughput']:8.1f} tok/s  decode {fmt(metrics['decode_throughput_per_request'], '.1f')} tok/s/req  TPOT {fmt(metrics['mean_tpot_ms'])} ms  "
                      f"{metrics['failed']} failed", flush=True)
    for row in rows.values():
        row["median"] = medians(row["runs"])
    return list(rows.values())


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


def print_table(rows: list[dict], names: list[str], rounds: int) -> None:
    print(f"\nMedians over {rounds} round(s); ratios are to {names[0]!r}.")
    header = f"{'config':<16}{'conc':>5}" + "".join(f"{t:>20}" for t, _ in COLUMNS)
    header += f"{'accept len':>12}{'draft share':>13}{'hidden CPU':>12}{'failed':>8}"
    print(header)
    print("-" * len(header))
    for concurrency in sorted({r["max_concurrency"] for r in rows}):
        group = {r["config"]: r["median"] for r in rows if r["max_concurrency"] == concurrency}
        base = group[names[0]]
        for name in names:
            m = group[name]
            line = f"{name:<16}{concurrency:>5}" + "".join(f"{with_ratio(m[k], base[k]):>20}" for _, k in COLUMNS)
            line += (f"{fmt(m['accept_length']):>12}{fmt(m['draft_share']):>13}{fmt(m['hidden_cpu_fraction']):>12}"
                     f"{m['failed_total']:>8}")
            print(line)


# ---- arguments and main --------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", action="append", type=parse_config, required=True, metavar="NAME=FLAGS",
                        help="A configuration: a name and extra run.py flags (repeat; the first is the reference).")
    parser.add_argument("--model-path", default=str(REPO / "models" / "tandem-dense"), help="Passed to every server.")
    parser.add_argument("--server-args", default="", help="Extra run.py flags for every server.")
    parser.add_argument("--server-script", default=str(REPO / "run.py"), help="The server entry point.")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="Seconds to wait for /health.")
    parser.add_argument("--rounds", type=int, default=2, help="Each round runs every config once, order alternating.")
    parser.add_argument("--max-concurrency", default="1,16", help="Comma-separated concurrencies; each is a run.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every run and the medians.")
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a new temporary folder).")
    serving.add_client_args(parser)
    serving.add_workload_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.max_concurrency = [int(c) for c in args.max_concurrency.split(",") if c.strip()]
        if not args.max_concurrency or min(args.max_concurrency) < 1:
            raise ValueError
    except ValueError:
        parser.error("--max-concurrency wants positive integers, e.g. 1,16")
    names = [name for name, _ in args.config]
    if len(set(names)) != len(names):
        parser.error("config names must differ")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not Path(args.server_script).is_file():
        parser.error(f"server script {args.server_script} not found")
    args.tokenizer = args.tokenizer or args.model_path
    try:
        serving.finish_args(bench_namespace(args, "http://127.0.0.1", args.max_concurrency[0]))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def common_flags(args) -> list[str]:
    """--server-args, plus a share of device memory per server unless a flag sets it."""
    common = shlex.split(args.server_args)
    everything = common + [f for _, flags in args.config for f in flags]
    if len(args.config) > 1 and not any(f.startswith("--mem-fraction-static") for f in everything):
        common += ["--mem-fraction-static", f"{0.85 / len(args.config):.2f}"]
    return common


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        common = common_flags(args)
        for name, flags in args.config:
            servers.append(start_server(args, name, flags, common, log_dir))
        print(f"started {len(servers)} servers (logs in {log_dir}); waiting for /health", flush=True)
        wait_healthy(servers, args.health_timeout)
        rows = run_rounds(args, servers)
    except ServerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        stop_servers(servers)
    names = [name for name, _ in args.config]
    print_table(rows, names, args.rounds)
    if args.output_file:
        workload = {k: v for k, v in serving.args_record(args).items() if k != "config"}
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "configs": [{"name": n, "flags": f} for n, f in args.config], "rounds": args.rounds,
                  "workload": workload, "results": rows, "server_pids": [s.process.pid for s in servers]}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(serving.jsonable(record)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
