"""Tandem against llama.cpp's `llama-server` (and vLLM's CPU server) on the same weights, side by side in one run.

    python bench/baseline_llamacpp.py --llama-cpp ~/llama.cpp --outtype f32 --max-concurrency 1,16 --rounds 3
    python bench/baseline_llamacpp.py --llama-cpp ~/llama.cpp --outtype bf16 \\
        --config "none=--speculative-algorithm none" --config "eagle=--speculative-algorithm eagle"
    python bench/baseline_llamacpp.py --llama-cpp ~/llama.cpp --model-path .build/models/llama-270m --outtype q4_0 \\
        --vllm-python ~/vllm-venv/bin/python --config "none=--speculative-algorithm none"

Converts the model (--model-path: the embedded model, or a folder from bench/make_model.py) to GGUF with llama.cpp's
own `convert_hf_to_gguf.py` (once; kept in --gguf-dir and made again when the model is newer); q4_0 is
`llama-quantize` of the f32 GGUF, as llama.cpp makes it. Starts `llama-server` on it with --parallel slots and
--threads threads, with --vllm-python vLLM's CPU server on the model folder (bench/baseline_vllm.py), Tandem once
per --config, and runs the same workload on every server in alternating rounds through the OpenAI completions API
(`bench/serving.py --backend openai`: the same text prompts, greedy, ignore_eos, streamed). Prints medians with
ratios to llama-server (the first row; then vLLM, then Tandem's configs), and each server's resident memory.

Like for like: Tandem gets the --dtype holding the GGUF's numbers (float32 for f32, bfloat16 for bf16) unless a
flag of its own sets one (q8_0 and q4_0 have none: set --quantization in --server-args or a --config), and vLLM
the same by default (--vllm-dtype). No server reuses a prompt's KV across requests: llama-server's prompt cache is
off (--llama-prompt-cache), vLLM's prefix caching is off, and Tandem keeps none, so every TTFT is a whole prefill.

All servers stay up through the rounds. An idle server takes next to nothing, but vLLM's OpenMP threads spin on
the cores for a moment after its last answer; so every run, whichever server it goes to, starts only once all the
servers have gone quiet (`wait_quiet`; the seconds waited are kept as `quiet_wait_s`). Stopping vLLM between its
rounds instead would cost its start-up, a compilation included, every round.

llama.cpp is not a dependency of Tandem: build it once (bench/README.md says how long that takes), e.g. from the
sources that the llama-cpp-python sdist vendors:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server llama-quantize -j2
    pip install sentencepiece          # the converter imports it (with numpy, which Tandem has)

The converter checks the tokenizer's pre-tokenizer against a table of known hashes; the embedded tokenizer is
GPT-2-style byte-level BPE, so the conversion runs with `get_vocab_base_pre` answering "gpt-2".
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import baseline_vllm, compare, serving  # noqa: E402
from bench.worktree import WORKING_TREE  # noqa: E402

# The converter writes these itself; the others are llama-quantize's of the f32 GGUF.
CONVERTED = ("f32", "bf16", "f16", "q8_0")
QUANTIZED = ("q4_0",)
OUTTYPES = CONVERTED + QUANTIZED
# Tandem's --dtype holding a GGUF type's numbers.
TANDEM_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
QUIET_SHARE = 0.1                   # of one core: a server using less than this is idle
QUIET_WINDOW_S = 0.5
# Run by the project's Python with llama.cpp's folder first on sys.path: the converter, its pre-tokenizer check
# answered for a GPT-2-style BPE tokenizer, then its own command line.
CONVERT = """
import sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import convert_hf_to_gguf as convert
try:
    from conversion.base import TextModel
except ImportError:
    TextModel = convert.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = "convert_hf_to_gguf.py"
convert.main()
"""


# ---- llama.cpp: its tools, the GGUF, the server ------------------------------------------

@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    converter: Path
    quantize: Path | None           # only where --outtype needs it


def llama_paths(root: Path, server: str | None = None, outtype: str = "f32") -> LlamaCpp:
    """llama-server (`server` when given), convert_hf_to_gguf.py and, for the quantized types, llama-quantize in a
    llama.cpp checkout; a clear error naming what is missing."""
    found = [Path(server)] if server else [root / "build" / "bin" / "llama-server", root / "llama-server"]
    binary = next((p for p in found if p.is_file()), None)
    script = root / "convert_hf_to_gguf.py"
    quantize = next((p for p in (root / "build" / "bin" / "llama-quantize", root / "llama-quantize") if p.is_file()),
                    None)
    missing = [what for what, there in (("build/bin/llama-server", binary), ("convert_hf_to_gguf.py", script.is_file()),
                                        ("build/bin/llama-quantize", quantize or outtype not in QUANTIZED))
               if not there]
    if missing:
        raise SystemExit(f"error: {root} needs {' and '.join(missing)} (see --help)")
    return LlamaCpp(binary, script, quantize if outtype in QUANTIZED else None)


def gguf_path(args, outtype: str) -> Path:
    return Path(args.gguf_dir) / f"{Path(args.model_path).resolve().name}-{outtype}.gguf"


def up_to_date(gguf: Path, model: Path) -> bool:
    """Made after the model's files were (a model made again keeps its folder's name)."""
    sources = [p.stat().st_mtime for p in model.iterdir() if p.suffix in (".json", ".safetensors")]
    return gguf.is_file() and gguf.stat().st_mtime >= max(sources, default=0.0)


def run_tool(command: list[str], what: str, out: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        out.unlink(missing_ok=True)
        raise SystemExit(f"error: {what} failed:\n{done.stderr[-3000:]}")


def gguf_for(args, tools: LlamaCpp, outtype: str | None = None) -> Path:
    """The model as GGUF of --outtype (or `outtype`), made once into --gguf-dir."""
    outtype = outtype or args.outtype
    model = Path(args.model_path).resolve()
    out = gguf_path(args, outtype)
    if up_to_date(out, model):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if outtype in QUANTIZED:
        source = gguf_for(args, tools, "f32")
        run_tool([str(tools.quantize), str(source), str(out), outtype.upper(), str(args.threads)],
                 f"quantizing {source} to {outtype}", out)
    else:
        run_tool([sys.executable, "-c", CONVERT, str(tools.converter.parent.resolve()), str(model),
                  "--outtype", outtype, "--outfile", str(out)], f"converting {model} to GGUF", out)
    return out


def llama_server_command(args, binary: Path, gguf: Path, port: int) -> list[str]:
    slots = max(args.max_concurrency)
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
               "--threads", str(args.threads), "--ctx-size", str(slots * args.slot_context), "--no-webui"]
    if args.llama_prompt_cache == "off":        # Tandem keeps no prompt prefix across requests: like for like
        command += ["--no-cache-prompt", "--cache-ram", "0"]
    return command


def start_process(name: str, command: list[str], log_dir: Path, port: int,
                  env: dict[str, str] | None = None) -> compare.Server:
    """A baseline server in a session of its own (stopped as a group, like Tandem's), logging to log_dir."""
    spec = compare.ServerSpec(name, tuple(command[1:]), WORKING_TREE)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env)
    return compare.Server(spec, port, process, log_path)


def start_baselines(args, tools: LlamaCpp, gguf: Path, log_dir: Path) -> list[compare.Server]:
    port = compare.free_port()
    servers = [start_process(f"llama.cpp-{args.outtype}", llama_server_command(args, tools.server, gguf, port),
                             log_dir, port)]
    if args.vllm_python:
        port = compare.free_port()
        command = baseline_vllm.vllm_command(args.vllm_python, Path(args.model_path).resolve(), args.vllm_dtype,
                                             port, args.vllm_args)
        env = baseline_vllm.vllm_env(args.threads, args.vllm_kv_cache_gib)
        servers.append(start_process(f"vLLM-{args.vllm_dtype}", command, log_dir, port, env))
    return servers


# ---- rounds: each run on a quiet machine ---------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User and system time of a process and its descendants so far."""
    ticks = 0
    for process in [pid, *compare.descendants(pid)]:
        try:
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(servers: list[compare.Server], timeout: float) -> float:
    """Seconds until all the servers together used under QUIET_SHARE of a core over one QUIET_WINDOW_S (at most
    `timeout`)."""
    start = time.monotonic()
    while True:
        before = sum(cpu_seconds(s.process.pid) for s in servers)
        time.sleep(QUIET_WINDOW_S)
        used = sum(cpu_seconds(s.process.pid) for s in servers) - before
        if used < QUIET_SHARE * QUIET_WINDOW_S or time.monotonic() - start >= timeout:
            return time.monotonic() - start


def run_rounds(args, servers: list[compare.Server]) -> list[dict]:
    """compare.run_rounds, with every run starting once the servers have gone quiet."""
    rows = {(s.name, c): {"config": s.name, "max_concurrency": c, "runs": []}
            for s in servers for c in args.max_concurrency}
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for server in order:
            for concurrency in args.max_concurrency:
                waited = wait_quiet(servers, args.quiet_timeout)
                metrics = compare.run_once(args, server, concurrency)
                metrics["quiet_wait_s"] = waited
                rows[server.name, concurrency]["runs"].append(metrics)
                print(f"round {round_index + 1}/{args.rounds}  {server.name:<20} concurrency {concurrency:<4} "
                      f"{metrics['output_throughput']:8.1f} tok/s  "
                      f"decode {compare.fmt(metrics['decode_throughput_per_request'], '.1f')} tok/s/req  "
                      f"TTFT {compare.fmt(metrics['mean_ttft_ms'])} ms  {metrics['failed']} failed  "
                      f"(waited {waited:.1f} s for quiet)", flush=True)
    for row in rows.values():
        row["median"] = compare.medians(row["runs"])
    return list(rows.values())


def measure(args, tools: LlamaCpp, gguf: Path, log_dir: Path) -> tuple[list[compare.Server], dict, list[dict]]:
    servers: list[compare.Server] = []
    try:
        servers += start_baselines(args, tools, gguf, log_dir)
        common = compare.common_flags(args, len(args.config))
        for spec in compare.plan_servers(args.config, [WORKING_TREE]):
            servers.append(compare.start_server(args, spec, common, log_dir))
        print(f"started {len(servers)} servers (logs in {log_dir}); waiting for /health", flush=True)
        failed = compare.wait_healthy(servers, args.health_timeout)
        compare.stop_servers([s for s in servers if s.name in failed])      # one that timed out may still run
        healthy = [s for s in servers if s.name not in failed]
        compare.note_memory(healthy, "started")
        rows = run_rounds(args, healthy) if len(healthy) > 1 else []
        compare.note_memory(healthy, "after the rounds")
        return servers, failed, rows
    finally:
        compare.stop_servers(servers)


# ---- arguments and main --------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--llama-cpp", required=True,
                        help="A llama.cpp checkout with build/bin/llama-server (and llama-quantize for q4_0).")
    parser.add_argument("--llama-server", help="The llama-server binary, when not LLAMA_CPP/build/bin/llama-server "
                                               "(another build of the same checkout).")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32",
                        help="GGUF weight type (q4_0: llama-quantize of the f32 GGUF).")
    parser.add_argument("--gguf-dir", default=str(Path(tempfile.gettempdir()) / "tandem-gguf"),
                        help="Where converted models are kept.")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama-server --threads (and llama-quantize's, and the CPUs vLLM's threads are bound to).")
    parser.add_argument("--llama-prompt-cache", choices=("off", "on"), default="off",
                        help="llama-server's prompt cache (its default: on). Off: every request prefills its whole "
                             "prompt, as on Tandem, which keeps no prefix across requests; on: the workload's prompts, "
                             "repeated every round, are prefilled once.")
    parser.add_argument("--slot-context", type=int, default=2048, help="Context of each llama-server slot.")
    parser.add_argument("--config", action="append", type=compare.parse_config, metavar="NAME=FLAGS",
                        help="A Tandem configuration (repeat; default: none=--speculative-algorithm none).")
    parser.add_argument("--model-path", default=str(compare.MODELS / "tandem-dense"), help="Every server's model.")
    parser.add_argument("--server-args", default="", help="Extra run.py flags for every Tandem server.")
    parser.add_argument("--server-script", default=str(compare.REPO / "run.py"), help="Tandem's entry point.")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="Seconds to wait for /health.")
    parser.add_argument("--quiet-timeout", type=float, default=10.0,
                        help="Longest wait, before each run, for the servers to go quiet.")
    parser.add_argument("--rounds", type=int, default=3, help="Each round runs every server once, order alternating.")
    parser.add_argument("--max-concurrency", default="1,16", help="Comma-separated concurrencies; each is a run.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every run and the medians.")
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a new temporary folder).")
    baseline_vllm.add_vllm_args(parser)
    serving.add_client_args(parser)
    serving.add_workload_args(parser)
    return parser


def with_dtype(flags: list[str], common: list[str], outtype: str) -> list[str]:
    """A config's flags, with the --dtype holding the GGUF's numbers unless they or --server-args set one."""
    dtype = TANDEM_DTYPE.get(outtype)
    if dtype is None or any(f == "--dtype" or f.startswith("--dtype=") for f in flags + common):
        return flags
    return [*flags, "--dtype", dtype]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = args.config or [compare.parse_config("none=--speculative-algorithm none")]
    common = shlex.split(args.server_args)
    args.config = [(name, with_dtype(flags, common, args.outtype)) for name, flags in configs]
    if not Path(args.model_path).is_dir():
        parser.error(f"--model-path {args.model_path} is not a folder")
    args.vllm_dtype = args.vllm_dtype or baseline_vllm.DTYPE_OF_OUTTYPE[args.outtype]
    args.backend = "openai"                  # one API on every side: /v1/completions, text prompts
    compare.check_run_args(parser, args)
    return args


def write_record(args, gguf: Path, servers: list[compare.Server], failed: dict, rows: list[dict]) -> None:
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "outtype": args.outtype, "gguf": str(gguf),
              "model": str(Path(args.model_path).resolve()),
              "vllm_dtype": args.vllm_dtype if args.vllm_python else None,
              "workload": {k: v for k, v in serving.args_record(args).items() if k != "config"},
              "servers": [{"name": s.name, "flags": list(s.spec.flags), "memory_mb": s.memory_mb} for s in servers],
              "failed_servers": failed, "rounds": args.rounds, "results": rows}
    with open(args.output_file, "a") as f:
        f.write(json.dumps(serving.jsonable(record)) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = llama_paths(Path(args.llama_cpp), args.llama_server, args.outtype)
    if args.vllm_python:
        print(f"vLLM {baseline_vllm.check_vllm(args.vllm_python)} ({args.vllm_python}), {args.vllm_dtype}", flush=True)
    gguf = gguf_for(args, tools)
    print(f"llama-server {tools.server} on {gguf} ({args.outtype}, {gguf.stat().st_size / 2**20:.1f} MB)", flush=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, failed, rows = measure(args, tools, gguf, log_dir)
    for name, why in failed.items():
        print(f"not measured: {name} {why}")
    if not rows:
        print("error: llama-server and at least one other server must answer /health", file=sys.stderr)
        return 1
    compare.print_table(rows, [s.name for s in servers if s.name not in failed], args.rounds)
    compare.print_memory(servers)
    if args.output_file:
        write_record(args, gguf, servers, failed, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
