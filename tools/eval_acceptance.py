"""Mean accepted tokens per verify step for Tandem's EAGLE heads (greedy chain drafting).

    python tools/eval_acceptance.py --models models --json out/acceptance.json

For each held-out prompt the target (transformers, full recompute) yields the
bonus token and features; the head drafts k tokens autoregressively (step 1:
target feature at the last verified position + bonus token; later steps: its
own output + the drafted token); the target verifies. Accepted per verify =
longest matching draft prefix + 1 (the target's own next token).
Also times one draft step against one target decode step (batch 1, KV cache).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402
from tiny_heads import Eagle3Head, load_head, target_features  # noqa: E402

HEADS = {"tandem-dense-eagle": "tandem-dense", "tandem-dense-eagle3": "tandem-dense",
         "tandem-moe-eagle": "tandem-moe"}


def heldout_prompts(tok, n: int, length: int) -> list[list[int]]:
    """n prompts of ``length`` tokens, from a third of the way into held-out files."""
    files = [t for _, t in tiny_corpus.heldout_texts()]
    tok.model_max_length = 10**9  # whole files are encoded only to cut prompts
    encoded = [tok(t, add_special_tokens=False).input_ids for t in files]
    encoded = [e for e in encoded if len(e) >= 3 * length]
    pick = [encoded[i * len(encoded) // n] for i in range(n)] if len(encoded) >= n else encoded
    return [e[len(e) // 3 : len(e) // 3 + length] for e in pick]


def _features(head, target, ids: list[int]):
    """(logits [L,V], per-position head inputs [L,H]) for a token list."""
    cap = head.capture_layers if isinstance(head, Eagle3Head) else ()
    logits, f, aux = target_features(target, torch.tensor([ids]), cap)
    feats = head.project(aux) if isinstance(head, Eagle3Head) else f
    return logits[0], feats[0]


@torch.no_grad()
def chain_accept(head, target, prompt: list[int], gen_len: int, k: int) -> list[int]:
    """Accepted tokens per verify step while generating ~gen_len tokens."""
    logits, feats = _features(head, target, prompt)
    seq, bonus, counts = list(prompt), int(logits[-1].argmax()), []
    while sum(counts) < gen_len:
        n_ctx = len(seq)
        ids_in = torch.tensor([seq[1:] + [bonus]])
        cache: dict = {}
        g = head(ids_in, feats[None, :n_ctx], pos=0, cache=cache)[:, -1:]
        drafts = []
        for i in range(k):
            d = head.to_target(head.logits(g).argmax(-1))
            drafts.append(int(d))
            if i < k - 1:
                g = head(d, g, pos=n_ctx + i, cache=cache)
        logits, feats = _features(head, target, seq + [bonus] + drafts)
        preds = logits[n_ctx:].argmax(-1).tolist()
        n = 0
        while n < k and drafts[n] == preds[n]:
            n += 1
        seq, bonus = seq + [bonus] + drafts[:n], preds[n]
        counts.append(n + 1)
    return counts


@torch.no_grad()
def step_costs(head, target, ctx: list[int], reps: int) -> tuple[float, float]:
    """Median seconds of one target decode step and one draft step (batch 1, cached)."""
    from transformers import DynamicCache

    ids = torch.tensor([ctx])
    kv = DynamicCache()
    key = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    target(input_ids=ids, use_cache=True, **{key: kv})
    n = ids.shape[1]
    tok = ids[:, -1:]
    _, feats = _features(head, target, ctx)
    cache: dict = {}
    g = head(ids[:, 1:], feats[None, :-1], pos=0, cache=cache)[:, -1:]
    base_k, base_v = cache["k"], cache["v"]
    t_target, t_draft = [], []
    for _ in range(reps):  # interleaved, so both see the same machine load
        t0 = time.perf_counter()
        out = target(input_ids=tok, use_cache=True, **{key: kv})
        out.logits[:, -1].argmax(-1)
        t_target.append(time.perf_counter() - t0)
        kv.crop(-1)
        t0 = time.perf_counter()
        g2 = head(tok, g, pos=n - 1, cache=cache)
        head.to_target(head.logits(g2).argmax(-1))
        t_draft.append(time.perf_counter() - t0)
        cache["k"], cache["v"] = base_k, base_v
    return statistics.median(t_target), statistics.median(t_draft)


def run(models: Path, n_prompts=32, prompt_len=64, gen_len=64, steps=(1, 3, 5), heads=None,
        reps=200, log=print) -> dict:
    """Evaluate every head folder present under ``models``; returns a result dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    results = {"n_prompts": n_prompts, "prompt_len": prompt_len, "gen_len": gen_len,
               "greedy": True, "heads": {}}
    targets: dict = {}
    prompts = None
    for name, tname in HEADS.items():
        if heads and name not in heads or not (models / name / "config.json").exists():
            continue
        if tname not in targets:
            targets[tname] = AutoModelForCausalLM.from_pretrained(str(models / tname), dtype=torch.float32).eval()
        target = targets[tname]
        if prompts is None:
            prompts = heldout_prompts(AutoTokenizer.from_pretrained(str(models / tname)), n_prompts, prompt_len)
            results["n_prompts"] = len(prompts)
        head = load_head(models / name, target).eval()
        row = {"target": tname, "accept": {}}
        for k in steps:
            t0 = time.time()
            counts = [c for p in prompts for c in chain_accept(head, target, p, gen_len, k)]
            row["accept"][str(k)] = round(sum(counts) / len(counts), 3)
            log(f"{name} k={k}: {row['accept'][str(k)]:.3f} accepted/verify "
                f"({len(counts)} verifies, {time.time() - t0:.0f}s)")
        t_tgt, t_dft = step_costs(head, target, prompts[0] + prompts[1], reps)
        row.update(target_step_ms=round(t_tgt * 1e3, 3), draft_step_ms=round(t_dft * 1e3, 3),
                   draft_target_cost_ratio=round(t_dft / t_tgt, 3))
        log(f"{name}: target step {t_tgt * 1e3:.2f} ms, draft step {t_dft * 1e3:.2f} ms, "
            f"ratio {t_dft / t_tgt:.3f}")
        results["heads"][name] = row
    return results


def table(res: dict) -> str:
    steps = sorted({k for r in res["heads"].values() for k in r["accept"]}, key=int)
    lines = ["| head | target | " + " | ".join(f"k={k}" for k in steps) + " | draft/target step cost |",
             "|---|---|" + "---|" * len(steps) + "---|"]
    for name, r in res["heads"].items():
        lines.append(f"| {name} | {r['target']} | " + " | ".join(f"{r['accept'][k]:.2f}" for k in steps)
                     + f" | {r['draft_target_cost_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--steps", default="1,3,5")
    ap.add_argument("--heads", default="", help="comma list of head folders (default: all)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default="", help="write results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    res = run(Path(args.models), args.prompts, args.prompt_len, args.gen,
              tuple(int(s) for s in args.steps.split(",")), [h for h in args.heads.split(",") if h], args.reps)
    print(table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
