"""Reproduce Tandem's embedded tiny models from scratch (CPU, deterministic seeds).

    python tools/train_tiny.py --out models
    python tools/train_tiny.py --out models --stages eagle-dense,eval,cards

Stages: tokenizer, dense, moe, eagle-dense, eagle3-dense, eagle-moe, draft-dense, eval, cards.
Each training stage stops at its step budget or its time budget (--minutes-*),
whichever comes first; the cosine schedule follows the same progress measure.
Intermediate data (token streams, stats) lives in --cache (default out/tiny).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402
from tiny_corpus import batches, lr_at, optimizer_step  # noqa: E402
from tiny_train_heads import train_head  # noqa: E402

STAGES = ["tokenizer", "dense", "moe", "eagle-dense", "eagle3-dense", "eagle-moe", "draft-dense", "eval", "cards"]
SAMPLE_PROMPTS = [  # end mid-line: a trailing newline splits BPE's "\n + indent" tokens
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return',
    'import os\n\n\ndef list_python_files(path):\n    """Return the .py files under path."""\n    result = []\n    for',
    'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):\n        self',
]


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def save_stats(args, stage: str, stats: dict) -> None:
    d = Path(args.cache) / "stats"
    d.mkdir(parents=True, exist_ok=True)
    stats.setdefault("command", args.command)
    (d / f"{stage}.json").write_text(json.dumps(stats, indent=2) + "\n")


def load_stats(args, stage: str) -> dict:
    p = Path(args.cache) / "stats" / f"{stage}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def dense_config(tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tiny_corpus.VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def moe_config(tok):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=tiny_corpus.VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
        router_aux_loss_coef=0.01, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def train_target(model, stream, args, minutes: float, max_steps: int, moe: bool) -> dict:
    """Pretrain a causal LM with AdamW + bf16 autocast; returns training stats."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    data = batches(stream, args.batch, args.seq, args.seed + 1)
    t0, step, budget = time.time(), 0, minutes * 60
    while True:
        progress = max(step / max_steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(args.lr, step, progress, args.warmup)
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            extra = {"output_router_logits": True} if moe else {}
            loss = model(input_ids=x, labels=x, **extra).loss
        loss.backward()
        optimizer_step(model.parameters(), opt)
        step += 1
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t0
            log(f"step {step} loss {loss.item():.4f} lr {g['lr']:.2e} "
                f"tok/s {step * x.numel() / el:.0f} elapsed {el / 60:.1f}m")
    el = time.time() - t0
    return {"steps": step, "tokens_seen": step * args.batch * args.seq, "train_seconds": round(el, 1),
            "tokens_per_second": round(step * args.batch * args.seq / max(el, 1e-9)),
            "final_train_loss": round(loss.item(), 4)}


@torch.no_grad()
def heldout_loss(model, stream, seq: int, max_windows: int) -> float:
    """Mean next-token loss over non-overlapping held-out windows (fp32)."""
    model.eval()
    n = min(stream.numel() // seq, max_windows)
    windows = stream[: n * seq].view(n, seq)
    total = 0.0
    for i in range(0, n, 16):
        x = windows[i : i + 16]
        total += model(input_ids=x, labels=x).loss.item() * x.shape[0]
    return total / n


@torch.no_grad()
def samples(model, tok, max_new: int = 64) -> list[dict]:
    out = []
    for p in SAMPLE_PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append({"prompt": p, "completion": tok.decode(gen[0, ids.shape[1]:])})
    return out


def patch_config(folder: Path, moe: bool) -> None:
    """Add legacy keys (rope_theta, num_experts, torch_dtype) that other loaders read."""
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    if moe:
        cfg.setdefault("num_experts", cfg.get("num_local_experts", 8))
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def stage_tokenizer(args):
    t0 = time.time()
    stats = tiny_corpus.build(Path(args.cache), Path(args.cache) / "tokenizer")
    stats["seconds"] = round(time.time() - t0, 1)
    log(f"tokenizer/corpus: {stats}")
    save_stats(args, "tokenizer", stats)


def stage_target(args, name: str):
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM, Qwen3MoeForCausalLM

    moe = name == "moe"
    torch.manual_seed(args.seed)
    tok = tiny_corpus.load_tokenizer(Path(args.cache) / "tokenizer")
    cfg = moe_config(tok) if moe else dense_config(tok)
    model = (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {n_params / 1e6:.2f}M params")
    stream = tiny_corpus.load_stream(Path(args.cache), "train")
    minutes = args.minutes_moe if moe else args.minutes_dense
    steps = args.steps_moe if moe else args.steps_dense
    stats = train_target(model, stream, args, minutes, steps, moe)
    folder = Path(args.out) / f"tandem-{name}"
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(folder))
    tiny_corpus.save_tokenizer(tok, folder)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, do_sample=False,
                     max_new_tokens=256).save_pretrained(str(folder))
    patch_config(folder, moe)
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    saved, trained = reloaded.state_dict(), model.state_dict()
    bad = [k for k in trained if not torch.equal(saved[k], trained[k].float())]
    assert not bad, f"reloaded checkpoint differs from the trained weights: {bad[:5]}"
    held = tiny_corpus.load_stream(Path(args.cache), "heldout")
    loss = heldout_loss(reloaded, held, args.seq, args.eval_windows)
    stats.update(params=n_params, heldout_loss=round(loss, 4), heldout_ppl=round(math.exp(loss), 2),
                 heldout_eval_tokens=min(held.numel() // args.seq, args.eval_windows) * args.seq,
                 samples=samples(reloaded, tok), seed=args.seed, batch=args.batch, seq=args.seq, lr=args.lr)
    log(f"{name}: held-out loss {loss:.4f} ppl {math.exp(loss):.2f}")
    for s in stats["samples"]:
        log(f"sample: {s['prompt']!r} -> {s['completion']!r}")
    save_stats(args, name, stats)


def stage_head(args, stage: str):
    from transformers import AutoModelForCausalLM

    target_name = "moe" if stage.endswith("moe") else "dense"
    kind = "eagle3" if stage.startswith("eagle3") else "eagle"
    target = AutoModelForCausalLM.from_pretrained(str(Path(args.out) / f"tandem-{target_name}"),
                                                  dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    key = stage.replace("-", "_")
    stream = tiny_corpus.load_stream(Path(args.cache), "train")
    folder = Path(args.out) / f"tandem-{target_name}-{kind}"
    stats = train_head(kind, target, stream, folder, args,
                       minutes=getattr(args, f"minutes_{key}"), max_steps=getattr(args, f"steps_{key}"), log=log)
    stats.update(seed=args.seed, target=f"tandem-{target_name}")
    save_stats(args, stage, stats)


def stage_draft(args):
    """tandem-dense-draft: a 2-layer LM distilled from tandem-dense (standalone speculation)."""
    from transformers import AutoModelForCausalLM
    from tiny_train_draft import train_draft

    target = AutoModelForCausalLM.from_pretrained(str(Path(args.out) / "tandem-dense"), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    stats = train_draft(target, args, Path(args.out) / "tandem-dense-draft", args.minutes_draft_dense,
                        args.steps_draft_dense, log)
    stats.update(seed=args.seed, target="tandem-dense")
    save_stats(args, "draft-dense", stats)


def stage_eval(args):
    import eval_acceptance

    res = eval_acceptance.run(Path(args.out), n_prompts=args.eval_prompts, prompt_len=64,
                              gen_len=args.eval_gen, steps=(1, 3, 5), log=log)
    save_stats(args, "acceptance", res)


def stage_cards(args):
    """Refresh greedy samples from the saved targets, then write every README.md."""
    import tiny_cards
    from transformers import AutoModelForCausalLM

    stats = {s: load_stats(args, s) for s in STAGES + ["acceptance"]}
    for name in ("dense", "moe"):
        folder = Path(args.out) / f"tandem-{name}"
        if stats[name] and folder.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            stats[name]["samples"] = samples(model, tiny_corpus.load_tokenizer(folder))
            save_stats(args, name, stats[name])
    tiny_cards.write_all(Path(args.out), stats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--cache", default="out/tiny")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--head-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-windows", type=int, default=1000)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-gen", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny budgets for a smoke test")
    # (minutes, max steps) per stage; the first limit reached ends the stage
    budgets = {"dense": (33, 100000), "moe": (14, 100000), "eagle_dense": (50, 100000),
               "eagle3_dense": (45, 100000), "eagle_moe": (12, 500), "draft_dense": (20, 100000)}
    for k, (m, s) in budgets.items():
        ap.add_argument(f"--minutes-{k.replace('_', '-')}", type=float, default=m)
        ap.add_argument(f"--steps-{k.replace('_', '-')}", type=int, default=s)
    args = ap.parse_args(argv)
    args.command = " ".join(["python tools/train_tiny.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        for k in budgets:
            setattr(args, f"steps_{k}", 3)
        args.log_every, args.eval_windows, args.eval_prompts, args.eval_gen = 1, 8, 2, 16
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    stages = args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}")
    t_all = time.time()
    for stage in STAGES:
        if stage not in stages:
            continue
        log(f"=== stage {stage}")
        t0 = time.time()
        if stage == "tokenizer":
            stage_tokenizer(args)
        elif stage in ("dense", "moe"):
            stage_target(args, stage)
        elif stage.startswith("eagle"):
            stage_head(args, stage)
        elif stage == "draft-dense":
            stage_draft(args)
        elif stage == "eval":
            stage_eval(args)
        elif stage == "cards":
            stage_cards(args)
        log(f"=== stage {stage} done in {(time.time() - t0) / 60:.1f} min")
    log(f"all done in {(time.time() - t_all) / 60:.1f} min")


if __name__ == "__main__":
    main()
