"""On the stream: constrained rows' logits masked by their requests' grammars (engine/grammar.py),
with xgrammar's bitmask kernels (its CPU kernel here, its device kernel where the logits are).

A plain step masks each constrained row's logits, samples, and leaves the token pending in the
row's matcher (`leave_pending`), so the host reads it only when the next step needs it. A
speculative verify masks every position of a row's chain by the matcher walked along the row's
drafts (`mask_chain`): position i by the state after drafts 1..i, up to the first draft the grammar
refuses. Acceptance then compares drafts with the masked choices, so what a row accepts is exactly
what plain constrained decoding would emit (a refused draft is never the masked choice); the
matcher rolls back past the drafts it walked but the verify rejected and keeps the bonus pending
(`settle_chain`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from engine.grammar import Grammar

Grammars = Sequence["Grammar | None"]


def constrained(grammars: Grammars | None) -> list[int]:
    """The rows that have a grammar."""
    return [i for i, g in enumerate(grammars or ()) if g is not None]


def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab)


def mask_rows(logits: torch.Tensor, grammars: Grammars | None) -> None:
    """logits [N, V] of N sampling rows, masked in place where a row has a grammar."""
    rows = constrained(grammars)
    if not rows:
        return
    bitmask = new_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        grammars[i].settle()
        grammars[i].fill(bitmask, i)
    apply(logits, bitmask, rows)


def leave_pending(tokens: torch.Tensor, grammars: Grammars | None) -> None:
    """tokens [N]: each constrained row's sampled token, accepted by its matcher when next needed."""
    for i in constrained(grammars):
        grammars[i].pending = (tokens, i)


def mask_chain(logits: torch.Tensor, drafts: torch.Tensor, grammars: Grammars | None) -> dict[int, int]:
    """logits [B, k+1, V] of a verify, masked in place; drafts [B, k] (-1 past a row's width). Returns
    how many drafts each constrained row's matcher accepted (to roll back what the verify rejects)."""
    rows = constrained(grammars)
    if not rows:
        return {}
    batch, width, vocab = logits.shape
    flat = logits.view(batch * width, vocab)
    bitmask, indices, walked = new_bitmask(batch * width, vocab), [], {}
    chains = drafts[rows].tolist()
    for b, chain in zip(rows, chains):
        grammar, at = grammars[b], b * width
        grammar.settle()
        if grammar.ended:
            continue                  # a step past the request's end (overlap): its tokens are dropped
        grammar.fill(bitmask, at)
        indices.append(at)
        walked[b] = 0
        for d in chain:
            if d < 0 or not grammar.try_draft(d):
                break
            walked[b] += 1
            grammar.fill(bitmask, at + walked[b])
            indices.append(at + walked[b])
    if indices:
        apply(flat, bitmask, indices)
    return walked


def settle_chain(emitted: torch.Tensor, n: torch.Tensor, grammars: Grammars | None, walked: dict[int, int]) -> None:
    """After acceptance (n [B] drafts accepted, emitted [B, k+1]): each constrained row's matcher back to
    its accepted drafts, with the bonus emitted[b, n[b]] pending."""
    if not walked:
        return
    accepted = n.tolist()
    for b, count in walked.items():
        if accepted[b] > count and grammars[b].ended:
            continue                  # its chain reached the grammar's stop token: the request ends there
        if accepted[b] > count:
            raise RuntimeError(f"a verify accepted {accepted[b]} drafts of a constrained row whose grammar "
                               f"allowed {count}")
        grammars[b].rollback(count - accepted[b])
        grammars[b].pending = (emitted[b], accepted[b])
