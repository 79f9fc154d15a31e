"""A small stand-alone draft LM for `--speculative-algorithm standalone` with tandem-dense.

Same tokenizer and layout as the target (`LlamaForCausalLM`, tied embeddings), DRAFT_LAYERS
decoder layers. Initialised from the target's embeddings, first DRAFT_LAYERS layers and final
norm, then distilled: soft cross-entropy against the frozen target's next-token distribution on
random training windows (the draft is judged by agreeing with the target, not by perplexity).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tiny_corpus
from tiny_corpus import batches, lr_at, optimizer_step

DRAFT_LAYERS = 2
LR = 1e-3


def draft_from_target(target):
    """A DRAFT_LAYERS-layer copy of the target's config, initialised from the target's lower layers."""
    from transformers import LlamaForCausalLM

    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = DRAFT_LAYERS
    draft = LlamaForCausalLM(cfg)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS}
    draft.load_state_dict(state, strict=False)
    return draft


@torch.no_grad()
def agreement(draft, target, stream: torch.Tensor, seq: int, windows: int) -> float:
    """Fraction of held-out positions where the draft's argmax equals the target's."""
    draft.eval()
    n = min(stream.numel() // seq, windows)
    x = stream[: n * seq].view(n, seq)
    hits = total = 0
    for i in range(0, n, 16):
        w = x[i : i + 16]
        hits += (draft(input_ids=w).logits.argmax(-1) == target(input_ids=w).logits.argmax(-1)).sum().item()
        total += w.numel()
    return hits / total


def train_draft(target, args, folder: Path, minutes: float, max_steps: int, log) -> dict:
    torch.manual_seed(args.seed)
    draft = draft_from_target(target)
    draft.train()
    stream = tiny_corpus.load_stream(Path(args.cache), "train")
    data = batches(stream, args.batch, args.seq, args.seed + 11)
    opt = torch.optim.AdamW(draft.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    t0, step, budget = time.time(), 0, minutes * 60
    while True:
        progress = max(step / max_steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(LR, step, progress, args.warmup)
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                teacher = target(input_ids=x).logits.float().softmax(-1)
            logits = draft(input_ids=x).logits.float()
        loss = -(teacher * F.log_softmax(logits, -1)).sum(-1).mean()
        loss.backward()
        optimizer_step(draft.parameters(), opt)
        step += 1
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t0
            log(f"draft step {step} distill loss {loss.item():.4f} lr {g['lr']:.2e} elapsed {el / 60:.1f}m")
    el = time.time() - t0
    draft = draft.to(torch.bfloat16)
    draft.save_pretrained(str(folder))
    tiny_corpus.save_tokenizer(tiny_corpus.load_tokenizer(Path(args.cache) / "tokenizer"), folder)
    reloaded = type(draft).from_pretrained(str(folder), dtype=torch.float32)
    held = tiny_corpus.load_stream(Path(args.cache), "heldout")
    agree = agreement(reloaded, target, held, args.seq, min(args.eval_windows, 200))
    n_params = sum(p.numel() for p in reloaded.parameters())
    log(f"draft: saved {folder}; held-out top-1 agreement with the target {agree:.4f}")
    assert math.isfinite(loss.item())
    return {"steps": step, "tokens_seen": step * args.batch * args.seq, "train_seconds": round(el, 1),
            "layers": DRAFT_LAYERS, "params": n_params, "lr": LR, "batch": args.batch, "seq": args.seq,
            "final_distill_loss": round(loss.item(), 4), "heldout_top1_agreement": round(agree, 4)}
