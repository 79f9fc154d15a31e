"""Training loops for the EAGLE / EAGLE-3 draft heads on a frozen target.

Target features are computed on the fly (bf16 autocast) for random training
windows. Alignment at position t: inputs (token_{t+1}, feature_t); targets
f_{t+1} (EAGLE only) and the target's next-token distribution at t+1.
A HASS-style unroll of ``UNROLL`` steps trains later chain steps: step j+1
feeds the head's own step-j output from position t-1 in place of the feature.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from tiny_corpus import batches, lr_at, optimizer_step
from tiny_heads import Eagle3Head, EagleHead, target_features

UNROLL = 3
STEP_WEIGHTS = [1.0, 0.8, 0.6]
CE_WEIGHT = 0.5  # EAGLE: SmoothL1(g, f) + CE_WEIGHT * soft CE
NOISE = 0.05  # gaussian noise on f, relative to its RMS
AUX_IDS = [1, 3, 5]  # SGLang eagle_aux_hidden_state_layer_ids (outputs of these layers)
DRAFT_VOCAB = 1024


def head_config(target, arch: str, **extra) -> dict:
    """Llama-style config for a 1-layer head matching the target's shapes."""
    c = target.config
    cfg = {
        "architectures": [arch], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": 768, "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
    }
    cfg.update(extra)
    return cfg


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return -(probs * F.log_softmax(logits.float(), -1)).sum(-1).mean()


@torch.no_grad()
def draft_vocab(target, data, n_batches: int, size: int):
    """Most frequent target argmax tokens on training windows -> (draft->target ids, coverage)."""
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for _ in range(n_batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = target(input_ids=next(data)).logits
        counts += torch.bincount(logits.argmax(-1).flatten(), minlength=counts.numel())
    top = torch.sort(counts.argsort(descending=True, stable=True)[:size]).values
    return top, counts[top].sum().item() / counts.sum().item()


def build_head(kind: str, target, data, n_vocab_batches: int, log):
    if kind == "eagle":
        head = EagleHead(head_config(target, "LlamaForCausalLMEagle"), target)
        h = target.config.hidden_size
        with torch.no_grad():  # start as "pass the feature through": x = f + small
            head.fc.weight[:, h:].copy_(torch.eye(h))
            head.fc.weight[:, :h].mul_(0.1)
            head.fc.bias.zero_()
        return head, {}
    ids, cov = draft_vocab(target, data, n_vocab_batches, DRAFT_VOCAB)
    cfg = head_config(target, "LlamaForCausalLMEagle3", draft_vocab_size=DRAFT_VOCAB,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_IDS,
                                    "use_aux_hidden_state": True})
    head = Eagle3Head(cfg, target)
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[ids] = True
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
    log(f"eagle3 draft vocab {DRAFT_VOCAB}: covers {cov:.3f} of target argmax tokens")
    return head, {"draft_vocab_size": DRAFT_VOCAB, "draft_vocab_argmax_coverage": round(cov, 4)}


def unrolled_loss(kind, head, x, target):
    """Loss and per-step top-1 agreement with the target for one batch."""
    cap = head.capture_layers if kind == "eagle3" else ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, f, aux = target_features(target, x, cap)
    logits, f = logits.float(), f.float()
    ids = x[:, 1:]
    probs = F.softmax(logits[:, 1:], -1)
    want = probs.argmax(-1)
    if kind == "eagle":
        f_in = f[:, :-1]
        f_in = f_in + NOISE * f_in.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(f_in)
        f_out = f[:, 1:]
    else:
        sub = probs[..., head.t2d]
        probs = sub / sub.sum(-1, keepdim=True).clamp_min(1e-6)
        f_in = head.project(aux[:, :-1].float())
    inp, total, accs = f_in, 0.0, []
    for j in range(UNROLL):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = head(ids, inp)
            lg = head.logits(g)
        loss = CE_WEIGHT * soft_ce(lg, probs) if kind == "eagle" else soft_ce(lg, probs)
        if kind == "eagle":
            loss = loss + F.smooth_l1_loss(g.float(), f_out)
        total = total + STEP_WEIGHTS[j] * loss
        accs.append((head.to_target(lg.argmax(-1)) == want).float().mean().item())
        inp = torch.cat([f_in[:, :1], g[:, :-1].float()], 1)
    return total, accs


def train_head(kind, target, stream, folder, args, minutes, max_steps, log) -> dict:
    """Train one head with AdamW + cosine; save it in SGLang layout; return stats."""
    torch.manual_seed(args.seed)
    data = batches(stream, args.head_batch, args.seq, args.seed + 7)
    head, extra = build_head(kind, target, data, 2 if args.quick else 40, log)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    t0, step, budget, tok = time.time(), 0, minutes * 60, 0
    ema = None
    while True:
        progress = max(step / max_steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(2e-3, step, progress, 30)
        x = next(data)
        loss, accs = unrolled_loss(kind, head, x, target)
        loss.backward()
        optimizer_step(params, opt)
        step, tok = step + 1, tok + x.numel()
        ema = accs if ema is None else [0.95 * e + 0.05 * a for e, a in zip(ema, accs)]
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t0
            log(f"{kind} step {step} loss {loss.item():.4f} top1-agree/step "
                f"{' '.join(f'{a:.3f}' for a in ema)} tok/s {tok / el:.0f} elapsed {el / 60:.1f}m")
    el = time.time() - t0
    head.save_pretrained(folder)
    stats = {"kind": kind, "steps": step, "positions_seen": tok, "train_seconds": round(el, 1),
             "tokens_per_second": round(tok / max(el, 1e-9)), "unroll": UNROLL,
             "final_top1_agreement_per_step": [round(a, 4) for a in ema or []],
             "batch": f"{args.head_batch}x{args.seq}", "lr": 2e-3, "noise": NOISE if kind == "eagle" else 0.0}
    stats.update(extra)
    log(f"{kind}: saved {folder} after {step} steps ({el / 60:.1f} min)")
    assert math.isfinite(loss.item())
    return stats
