"""Baseline: the same prompts through Hugging Face transformers `generate` (greedy, static batches).

    python bench/baseline_hf.py --batch-size 1,16

Output lengths are exact (min_new_tokens = max_new_tokens, like ignore_eos). A static batch
runs until its longest request is done; only the tokens each request asked for count as
output. Prints one summary per batch size and appends JSON lines with --output-file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serving  # noqa: E402


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(name: str, device: str):
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, name)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate_batch(model, tokenizer, batch: list[serving.Request], device: str) -> tuple[float, int]:
    """Greedy-generate one static batch; returns (seconds, tokens generated including waste)."""
    steps = max(r.output_len for r in batch)
    encoded = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True).to(device)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**encoded, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    synchronize(device)
    return time.perf_counter() - start, (output.shape[1] - encoded["input_ids"].shape[1]) * len(batch)


def run_batch_size(args, model, tokenizer, requests: list[serving.Request], batch_size: int) -> dict:
    latencies, generated = [], 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        seconds, made = generate_batch(model, tokenizer, batch, args.device)
        latencies += [seconds] * len(batch)  # every request of a static batch ends with it
        generated += made
    duration = sum(latencies[i] for i in range(0, len(requests), batch_size))
    total_out = sum(r.output_len for r in requests)
    total_in = sum(r.prompt_len for r in requests)
    e2e = serving.stats("e2e_latency", latencies)
    return {"backend": "hf-transformers", "batch_size": batch_size, "device": args.device, "dtype": args.dtype,
            "num_threads": torch.get_num_threads(),
            "dataset_name": args.dataset_name, "completed": len(requests), "failed": 0, "duration": duration,
            "total_input_tokens": total_in, "total_output_tokens": total_out, "generated_tokens": generated,
            "request_throughput": len(requests) / duration, "input_throughput": total_in / duration,
            "output_throughput": total_out / duration, **e2e}


def print_summary(m: dict) -> None:
    print("{s:{c}^52}".format(s=f" HF generate, batch size {m['batch_size']} ", c="="))
    for label, key in [("Device / dtype:", None), ("Requests:", "completed"), ("Duration (s):", "duration"),
                       ("Total input tokens:", "total_input_tokens"), ("Total output tokens:", "total_output_tokens"),
                       ("Generated incl. batch padding:", "generated_tokens"),
                       ("Request throughput (req/s):", "request_throughput"),
                       ("Output token throughput (tok/s):", "output_throughput"),
                       ("Mean E2E Latency (ms):", "mean_e2e_latency_ms"),
                       ("Median E2E Latency (ms):", "median_e2e_latency_ms")]:
        value = f"{m['device']} / {m['dtype']}" if key is None else m[key]
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{text:>12}")
    print("=" * 52)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-path", default=str(serving.REPO / "models" / "tandem-dense"),
                        help="The Hugging Face checkpoint folder Tandem serves.")
    parser.add_argument("--batch-size", default="1,16", help="Comma-separated static batch sizes; each is a run.")
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on the CPU, bfloat16 elsewhere (as Tandem).")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own, one per core, as Tandem's CPU rank).")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per batch size.")
    serving.add_workload_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.batch_size = [int(b) for b in args.batch_size.split(",") if b.strip()]
        if not args.batch_size or min(args.batch_size) < 1:
            raise ValueError
    except ValueError:
        parser.error("--batch-size wants positive integers, e.g. 1,16")
    if not (Path(args.model_path) / "config.json").is_file():
        parser.error(f"no config.json in {args.model_path}")
    args.tokenizer = args.tokenizer or args.model_path
    if args.num_prompts < 1 or min(args.random_input_len, args.random_output_len) < 1:
        parser.error("--num-prompts and lengths must be at least 1")
    if args.dataset_name == "prompts" and not (args.dataset_path and Path(args.dataset_path).is_file()):
        parser.error("--dataset-name prompts needs --dataset-path to a JSONL file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers
    from packaging import version
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    args.device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, args.device)
    args.dtype = str(dtype).removeprefix("torch.")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype_kwarg = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(args.model_path, **{dtype_kwarg: dtype}).to(args.device).eval()
    requests = serving.build_requests(args, tokenizer)
    generate_batch(model, tokenizer, [serving.Request(requests[0].prompt, 0, 4)], args.device)  # warm-up
    for batch_size in args.batch_size:
        metrics = run_batch_size(args, model, tokenizer, requests, batch_size)
        print_summary(metrics)
        if args.output_file:
            record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), **metrics, "args": serving.args_record(args)}
            with open(args.output_file, "a") as f:
                f.write(json.dumps(serving.jsonable(record)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
