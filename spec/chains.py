"""Pieces the speculative workers share: a chain of drafts, per-row trimming of chains where the
device reads its tensors for free, and the per-row token history n-gram and standalone drafting read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.sampling import SamplingBatch

if TYPE_CHECKING:
    from engine.step import StepInputs, Target

# A chain stops below this top-1 probability of the draft: on held-out text the embedded EAGLE
# head's drafts that unlikely were accepted less than half of the time, and a chain step costs a
# fraction of a target step, so such a draft (and the chain behind it) costs more than it brings
# (bench/results/history/capped_chain.txt, eagle_trim.txt).
DRAFT_CONFIDENCE = 0.1


@dataclass
class Chain:
    """What a worker drafted for a step: drafts [B, w], their distributions q [B, w, V] (computed
    only when a row samples) and the drafts each row verifies [B] (None: all w)."""
    drafts: torch.Tensor
    probs: Callable[[], torch.Tensor]
    widths: torch.Tensor | None = None


def top_choice(logits: torch.Tensor, with_confidence: bool, kernels=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax of each row of draft logits, and its softmax probability when asked; in one native call
    where the draft model runs the CPU kernels (`kernels`: its module's, devices/cpu_native.py)."""
    if kernels is not None and logits.device.type == "cpu":
        top, confidence = kernels.top_choice(logits)
        return top, confidence if with_confidence else None
    top_logit, top = logits.max(dim=-1)
    if not with_confidence:
        return top, None
    return top, 1.0 / torch.exp(logits - top_logit[:, None]).sum(dim=-1)


def stack_chain(drafts: list[torch.Tensor], qs: list, rows: torch.Tensor, widths: torch.Tensor | None) -> Chain:
    drafts_t = torch.stack(drafts, dim=1) if drafts else rows.new_zeros(rows.shape[0], 0)
    return Chain(drafts_t, lambda: torch.stack(qs, dim=1), widths)


def greedy_chain(drafts: torch.Tensor, widths: torch.Tensor | None = None) -> Chain:
    """A whole chain of greedy drafts [B, k] (from a captured draft step or one native call: an
    all-greedy batch, whose verify never asks for q)."""
    def no_probs() -> torch.Tensor:
        raise RuntimeError("a greedy chain has no draft distributions")
    return Chain(drafts, no_probs, widths)


class ConfidenceTrim:
    """Where the device reads its tensors for free: which drafts of a chain each row verifies.
    A greedy row keeps its drafts up to the first with probability < DRAFT_CONFIDENCE; a sampling
    row keeps all (its output must not depend on what it is batched with)."""

    def __init__(self, greedy: torch.Tensor):
        self.greedy = greedy
        self.kept: list[torch.Tensor] = []          # kept[i][b]: row b verifies draft i+1

    def keep(self, confidence: torch.Tensor) -> bool:
        """Record the next draft's confidence [B]; False when no row verifies it (the chain ends)."""
        keep = ~((confidence < DRAFT_CONFIDENCE) & self.greedy)
        if self.kept:
            keep &= self.kept[-1]
        if not bool(keep.any()):
            return False
        self.kept.append(keep)
        return True

    def widths(self) -> torch.Tensor | None:
        """Drafts each row verifies [B] (None before any draft was kept)."""
        return torch.stack(self.kept, dim=1).sum(dim=1) if self.kept else None


class TokenHistory:
    """Per-row token history on the device: tokens[row, p] = the request's token at position p,
    valid for p <= kv_len[row] (the bonus sits at position kv_len). A prefill writes its chunk
    and, on the last chunk, the sampled token; a decode step writes its emitted tokens at
    L+1..L+R (only the first n+1 become valid; the rest lie past the valid end and are
    overwritten before they are read)."""

    def __init__(self, target: "Target"):
        self.tokens = torch.zeros(target.num_rows, target.table_width, dtype=torch.long,
                                  device=target.torch_device)

    def write_prefill(self, inp: "StepInputs", input_ids: torch.Tensor, positions: torch.Tensor,
                      sampled: torch.Tensor) -> None:
        dev = input_ids.device
        token_rows = inp.rows.to(dev).repeat_interleave(inp.q_lens.to(dev), output_size=input_ids.shape[0])
        self.tokens[token_rows, positions] = input_ids
        if sampled.numel():
            last_chunks = inp.spec.draft_next < 0                              # host: the sequences that sampled
            self.tokens[inp.rows[last_chunks].to(dev), inp.kv_lens[last_chunks].to(dev)] = sampled

    def write_step(self, rows: torch.Tensor, L: torch.Tensor, emitted: torch.Tensor) -> None:
        positions = L[:, None] + 1 + torch.arange(emitted.shape[1], device=rows.device)
        self.tokens[rows[:, None], positions.clamp(max=self.tokens.shape[1] - 1)] = emitted

    def write_known(self, row: int, token_ids: list[int]) -> None:
        """A request imported from elsewhere: its whole history at once."""
        self.tokens[row, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)


def expand(sb: SamplingBatch, times: int) -> SamplingBatch:
    """Repeat every row's sampling parameters `times` times (one per verify row)."""
    def rep(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(times, dim=0)
    return dataclasses.replace(sb, temperature=rep(sb.temperature), top_k=rep(sb.top_k), top_p=rep(sb.top_p),
                               min_p=rep(sb.min_p), greedy=rep(sb.greedy),
                               seeds=[s for s in sb.seeds for _ in range(times)],
                               positions=[p for p in sb.positions for _ in range(times)])
