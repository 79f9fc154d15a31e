"""Acceptance of a chain of k draft tokens against the target's k+1 verify rows.

Greedy: accept the longest prefix where draft i equals the target's argmax at row
i-1, then add the target's argmax at the first mismatch (the bonus), so every step
emits 1..k+1 tokens that are exactly plain greedy decoding's.

Sampling: accept draft i with probability min(1, p(d)/q(d)); at the first rejection
emit a token from norm(max(p - q, 0)); if all are accepted emit one from p at the
last row. The emitted tokens are distributed exactly as sampling from p.
"""
from __future__ import annotations

import torch


def accepted_length(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, k] bool -> number of leading True per row [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k]; target_logits [B, k+1, V] -> (emitted [B, k+1], n [B]); row i of
    emitted is valid for i <= n."""
    target = target_logits.argmax(dim=-1)                                # [B, k+1]
    n = accepted_length(drafts == target[:, :-1])
    return target, n


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   uniform: torch.Tensor, exponential: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k]; draft_probs [B, k, V] (q of each draft token's step); target_probs
    [B, k+1, V]; uniform [B, k] and exponential [B, V] noise. -> (emitted [B, k+1], n [B]).
    k may be 0 (a plain step): the one token is then sampled from p."""
    batch, k = drafts.shape
    p_at = target_probs[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)     # p_{i-1}(d_i)
    q_at = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    # u <= p/q without dividing by 0; a token p cannot give (masked by a grammar) is never accepted
    accept = (uniform * q_at <= p_at) & (p_at > 0)
    n = accepted_length(accept)
    rows = torch.arange(batch, device=drafts.device)
    p_last = target_probs[rows, n]                                           # [B, V]
    q_next = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)[rows, n]
    residual = (p_last - q_next).clamp(min=0)
    residual_mass = residual.sum(-1, keepdim=True)
    # All accepted (n == k): q_next is 0, so residual is p. A rejection with zero residual mass
    # cannot happen in exact arithmetic; fall back to p for safety.
    final = torch.where(residual_mass > 0, residual / residual_mass.clamp(min=1e-20), p_last)
    last = (final / exponential).argmax(dim=-1)
    emitted = torch.cat([drafts, last[:, None]], dim=1)
    emitted[rows, n] = last
    return emitted, n
