"""The Python side of bench/gpu_check.sh: make a Llama-shaped model with random weights on the spot,
and gather the check's results into one JSON file.

    python bench/gpu_check.py make-model --out /tmp/llama-1b              # ~1B parameters, bfloat16
    python bench/gpu_check.py make-model --out /tmp/tiny --hidden 64 --layers 2 --heads 4 --kv-heads 2 \\
        --intermediate 128
    python bench/gpu_check.py summarize --junit junit.xml --tests-rc 0 --compare compare.jsonl \\
        --bench-rc 0 --dp dp_check.json --dp-rc 0 --model /tmp/llama-1b --out gpu_check.json

The model borrows the embedded model's tokenizer (its vocabulary sets vocab_size), so the load tools
make prompts for it as for the embedded models.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "models" / "tandem-dense"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INIT_STD = 0.02


# ---- a Llama-shaped model with random weights ---------------------------------------------

def llama_config(args, vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "head_dim": args.hidden // args.heads, "max_position_embeddings": args.context,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": 0,
            "torch_dtype": "bfloat16"}


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint (Hugging Face names) and its shape."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config["vocab_size"], hidden)}
    layer = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def make_model(args) -> int:
    import torch
    from safetensors.torch import save_file
    vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
    config = llama_config(args, vocab)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:                                   # norms
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            values = torch.randn(shape, generator=generator, device=args.device, dtype=torch.float32) * INIT_STD
            weights[name] = values.to(torch.bfloat16).cpu()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (TOKENIZER / name).exists():
            shutil.copy(TOKENIZER / name, out / name)
    params = sum(t.numel() for t in weights.values())
    print(f"{out}: Llama-shaped, {params / 1e9:.2f}B parameters, random weights (seed {args.seed})")
    return 0


# ---- the results in one file ------------------------------------------------------------------

def test_results(junit: Path | None, rc: int | None) -> dict:
    """Counts and the names of failing tests from pytest's junit XML."""
    result: dict = {"rc": rc, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if junit is None or not junit.exists():
        result["note"] = "no junit XML (pytest did not run or was killed)"
        return result
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", "passed": "passed"}[outcome]
        result[key] += 1
        if outcome in ("failure", "error"):
            result["failures"].append(name)
    return result


BENCH_KEYS = ("output_throughput", "decode_throughput_per_request", "mean_tpot_ms", "median_tpot_ms",
              "mean_ttft_ms", "failed_total")


def bench_results(compare: Path | None, rc: int | None) -> dict:
    """Per config and concurrency, compare.py's medians; and graphs over eager per concurrency."""
    result: dict = {"rc": rc, "rows": [], "graphs_over_eager": {}}
    if compare is None or not compare.exists() or not compare.read_text().strip():
        result["note"] = "no compare.py record (the benchmark did not finish)"
        return result
    record = json.loads(compare.read_text().strip().splitlines()[-1])          # compare.py's write_record
    result["failed_servers"] = record.get("failed_servers", {})
    medians = {(row["config"], row["max_concurrency"]): row["median"] for row in record["results"]}
    result["rows"] = [{"config": config, "max_concurrency": conc, **{k: median.get(k) for k in BENCH_KEYS}}
                      for (config, conc), median in medians.items()]
    for (config, conc), median in medians.items():
        eager = medians.get(("eager", conc))
        if config == "graphs" and eager and eager.get("output_throughput") and median.get("output_throughput"):
            result["graphs_over_eager"][str(conc)] = median["output_throughput"] / eager["output_throughput"]
    return result


def dp_results(path: Path | None, rc: int | None) -> dict:
    """bench/dp_check.py's result: which backend ran DP attention on one GPU, and whether its output equals
    one engine's."""
    result: dict = {"rc": rc}
    if path is None or not path.exists() or not path.read_text().strip():
        result["note"] = "no dp_check.py result (it did not run or was killed)"
        return result
    return {**result, **json.loads(path.read_text())}


def environment() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        info["torch"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def summarize(args) -> int:
    model = Path(args.model) if args.model else None
    config = json.loads((model / "config.json").read_text()) if model and (model / "config.json").exists() else None
    summary = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment(),
               "tests": test_results(Path(args.junit) if args.junit else None, args.tests_rc),
               "benchmark": {"model": config, **bench_results(Path(args.compare) if args.compare else None,
                                                              args.bench_rc)},
               "dp_attention": dp_results(Path(args.dp) if args.dp else None, args.dp_rc),
               "seconds": args.seconds}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model", help="A Llama-shaped checkpoint with random weights.")
    make.add_argument("--out", required=True, help="Folder to write (config.json, model.safetensors, tokenizer).")
    for name, default in (("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("intermediate", 8192),
                          ("context", 4096), ("seed", 0)):
        make.add_argument(f"--{name}", type=int, default=default)
    make.add_argument("--device", default="cpu", help="Where the random numbers are drawn (cuda is faster).")
    summary = commands.add_parser("summarize", help="Gather the check's results into one JSON file.")
    summary.add_argument("--out", required=True)
    summary.add_argument("--junit", help="pytest's --junitxml file.")
    summary.add_argument("--tests-rc", type=int)
    summary.add_argument("--compare", help="compare.py's --output-file.")
    summary.add_argument("--bench-rc", type=int)
    summary.add_argument("--dp", help="bench/dp_check.py's --out file.")
    summary.add_argument("--dp-rc", type=int)
    summary.add_argument("--model", help="The benchmarked model's folder (its config goes in the summary).")
    summary.add_argument("--seconds", type=float, help="The whole check's wall time.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-model":
        if min(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.context) < 1:
            parser.error("model sizes must be positive")
        if args.hidden % args.heads or args.heads % args.kv_heads:
            parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return make_model(args) if args.command == "make-model" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
