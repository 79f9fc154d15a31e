"""Tandem against llama.cpp's `llama-server` on the same weights, side by side in one run.

    python bench/baseline_llamacpp.py --llama-cpp ~/llama.cpp --outtype f32 --max-concurrency 1,16 --rounds 3
    python bench/baseline_llamacpp.py --llama-cpp ~/llama.cpp --outtype bf16 --server-args "--dtype bfloat16" \\
        --config "none=--speculative-algorithm none" --config "eagle=--speculative-algorithm eagle"

Converts the embedded model (--model-path) to GGUF with llama.cpp's own `convert_hf_to_gguf.py` (once; kept in
--gguf-dir), starts `llama-server` on it with --parallel slots and --threads threads, starts Tandem once per
--config, and runs the same workload on every server in alternating rounds through the OpenAI completions API
(`bench/serving.py --backend openai`: the same text prompts, greedy, ignore_eos, streamed). Prints medians
with ratios to llama-server (the first row), and each server's resident memory.

llama.cpp is not a dependency of Tandem: build it once (about 9 minutes on 2 cores), e.g. from the sources that
the llama-cpp-python sdist vendors:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j2
    pip install sentencepiece          # the converter imports it (with numpy, which Tandem has)

The converter checks the tokenizer's pre-tokenizer against a table of known hashes; the embedded tokenizer is
GPT-2-style byte-level BPE, so the conversion runs with `get_vocab_base_pre` answering "gpt-2".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import compare, serving  # noqa: E402
from bench.worktree import WORKING_TREE  # noqa: E402

OUTTYPES = ("f32", "bf16", "f16", "q8_0")
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


def llama_paths(root: Path, server: str | None = None) -> tuple[Path, Path]:
    """(llama-server binary, convert_hf_to_gguf.py) in a llama.cpp checkout (the binary: `server` when
    given); a clear error when missing."""
    found = [Path(server)] if server else [root / "build" / "bin" / "llama-server", root / "llama-server"]
    binary = next((p for p in found if p.is_file()), None)
    script = root / "convert_hf_to_gguf.py"
    if binary is None or not script.is_file():
        raise SystemExit(f"error: {root} needs build/bin/llama-server and convert_hf_to_gguf.py (see --help)")
    return binary, script


def gguf_for(args) -> Path:
    """The model as GGUF of --outtype, converted once into --gguf-dir."""
    model = Path(args.model_path).resolve()
    out = Path(args.gguf_dir) / f"{model.name}-{args.outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", CONVERT, str(Path(args.llama_cpp).resolve()), str(model),
               "--outtype", args.outtype, "--outfile", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"error: converting {model} to GGUF failed:\n{done.stderr[-3000:]}")
    return out


def start_llama_server(args, binary: Path, gguf: Path, log_dir: Path) -> compare.Server:
    port = compare.free_port()
    slots = max(args.max_concurrency)
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
               "--threads", str(args.threads), "--ctx-size", str(slots * args.slot_context), "--no-webui"]
    if args.llama_prompt_cache == "off":        # Tandem keeps no prompt prefix across requests: like for like
        command += ["--no-cache-prompt", "--cache-ram", "0"]
    spec = compare.ServerSpec(f"llama.cpp-{args.outtype}", tuple(command[1:]), WORKING_TREE)
    log_path = log_dir / f"{spec.name}.log"
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    return compare.Server(spec, port, process, log_path)


def measure(args, binary: Path, gguf: Path, log_dir: Path) -> tuple[list[compare.Server], dict, list[dict]]:
    servers: list[compare.Server] = []
    try:
        servers.append(start_llama_server(args, binary, gguf, log_dir))
        common = compare.common_flags(args, len(args.config))
        for spec in compare.plan_servers(args.config, [WORKING_TREE]):
            servers.append(compare.start_server(args, spec, common, log_dir))
        print(f"started {len(servers)} servers (logs in {log_dir}); waiting for /health", flush=True)
        failed = compare.wait_healthy(servers, args.health_timeout)
        healthy = [s for s in servers if s.name not in failed]
        compare.note_memory(healthy, "started")
        rows = compare.run_rounds(args, healthy) if len(healthy) > 1 else []
        compare.note_memory(healthy, "after the rounds")
        return servers, failed, rows
    finally:
        compare.stop_servers(servers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, help="A llama.cpp checkout with build/bin/llama-server.")
    parser.add_argument("--llama-server", help="The llama-server binary, when not LLAMA_CPP/build/bin/llama-server "
                                               "(another build of the same checkout).")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32", help="GGUF weight type (match --dtype).")
    parser.add_argument("--gguf-dir", default=str(Path(tempfile.gettempdir()) / "tandem-gguf"),
                        help="Where converted models are kept.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server --threads.")
    parser.add_argument("--llama-prompt-cache", choices=("off", "on"), default="off",
                        help="llama-server's prompt cache (its default: on). Off: every request prefills its whole "
                             "prompt, as on Tandem, which keeps no prefix across requests; on: the workload's prompts, "
                             "repeated every round, are prefilled once.")
    parser.add_argument("--slot-context", type=int, default=2048, help="Context of each llama-server slot.")
    parser.add_argument("--config", action="append", type=compare.parse_config, metavar="NAME=FLAGS",
                        help="A Tandem configuration (repeat; default: none=--speculative-algorithm none).")
    parser.add_argument("--model-path", default=str(compare.MODELS / "tandem-dense"), help="Both sides' model.")
    parser.add_argument("--server-args", default="", help="Extra run.py flags for every Tandem server.")
    parser.add_argument("--server-script", default=str(compare.REPO / "run.py"), help="Tandem's entry point.")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="Seconds to wait for /health.")
    parser.add_argument("--rounds", type=int, default=3, help="Each round runs every server once, order alternating.")
    parser.add_argument("--max-concurrency", default="1,16", help="Comma-separated concurrencies; each is a run.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every run and the medians.")
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a new temporary folder).")
    serving.add_client_args(parser)
    serving.add_workload_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config = args.config or [compare.parse_config("none=--speculative-algorithm none")]
    args.backend = "openai"                  # one API on both sides: /v1/completions, text prompts
    compare.check_run_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary, _ = llama_paths(Path(args.llama_cpp), args.llama_server)
    gguf = gguf_for(args)
    print(f"llama-server {binary} on {gguf} ({args.outtype}, {gguf.stat().st_size / 2**20:.1f} MB)", flush=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, failed, rows = measure(args, binary, gguf, log_dir)
    for name, why in failed.items():
        print(f"not measured: {name} {why}")
    if not rows:
        print("error: llama-server and at least one Tandem server must answer /health", file=sys.stderr)
        return 1
    compare.print_table(rows, [s.name for s in servers if s.name not in failed], args.rounds)
    compare.print_memory(servers)
    if args.output_file:
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "outtype": args.outtype, "gguf": str(gguf),
                  "servers": [{"name": s.name, "flags": list(s.spec.flags), "memory_mb": s.memory_mb}
                              for s in servers],
                  "failed_servers": failed, "rounds": args.rounds, "results": rows}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(serving.jsonable(record)) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
