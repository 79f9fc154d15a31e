"""Speculative decoding plugs into the rank's ModelRunner: a worker owns the draft
side (a draft model and its KV cache, or none) and the per-row speculative state on
the device; the scheduler only knows that a decode step feeds k+1 tokens.

Per-row device state, written by the step that produced it and read by the next
(the device runs steps in order, so the CPU never waits for it):

  kv_len[row]        tokens of the request in the KV cache (target and draft share slots)
  bonus[row]         the last emitted token, not yet in the cache (fed first by the next verify)
"""
from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

from engine.models.attention import KVCache, build_attention_batch, padded_width
from engine.sampling import SamplingBatch, filtered_probs, seeded_noise
from spec.verify import verify_greedy, verify_sampled

if TYPE_CHECKING:
    from engine.model_runner import BatchInputs, ModelRunner, StepResult
    from engine.models.attention import AttentionBatch
    from engine.models.base import ModelOutput

ALGORITHMS = {
    "eagle": "spec.eagle_worker:EagleWorker",
    "eagle3": "spec.eagle_worker:EagleWorker",
    "standalone": "spec.standalone_worker:StandaloneWorker",
    "ngram": "spec.ngram_worker:NgramWorker",
}


def normalize_algorithm(name: str | None) -> str:
    name = (name or "none").lower()
    return "none" if name in ("none", "") else name


class SpecWorker(ABC):
    needs_aux = False          # the target must return EAGLE-3 aux hidden states
    catches_up = False         # the draft can skip prefill batches and read what it missed later

    def __init__(self, runner: "ModelRunner"):
        self.runner = runner
        rows, dev = runner.num_rows, runner.device.torch_device
        self.kv_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.bonus = torch.zeros(rows, dtype=torch.long, device=dev)
        # chains are trimmed per row (ConfidenceTrim, verify's widths) only where that costs no sync
        self.trims = runner.device.free_host_reads

    def describe(self) -> str:
        """For the start-up log line."""
        args = self.runner.args
        return f"{args.spec_algorithm}, {args.num_steps} steps"

    def mark(self, phase: str, marks: list) -> None:
        """Record the end of a phase (draft, verify, extend) of the step being launched."""
        marks.append((phase, self.runner.device.mark()))

    def start_step(self, inp: "BatchInputs") -> tuple[torch.Tensor, torch.Tensor, list]:
        """On the stream, at the start of a decode step: the batch's rows, their KV lengths L,
        and the phase marks begun with "start"."""
        rows = inp.rows.to(self.runner.device.torch_device)
        return rows, self.kv_len[rows], [("start", self.runner.device.mark())]

    def seed_sampled_rows(self, inp: "BatchInputs", sampled: torch.Tensor) -> torch.Tensor:
        """After a prefill: the rows whose prompt is now complete (those that sampled) start
        speculating at L = their prompt length with bonus = the sampled token. Returns the rows."""
        last_chunks = inp.draft_next < 0                                       # host: the sequences that sampled
        rows = inp.rows[last_chunks].to(sampled.device)
        self.kv_len[rows] = inp.kv_lens[last_chunks].to(sampled.device)
        self.bonus[rows] = sampled
        return rows

    def chain_trim(self, k: int, sb: SamplingBatch, dev: torch.device) -> "ConfidenceTrim | None":
        """The per-row trimming of this step's chain of k drafts, where chains are trimmed."""
        return ConfidenceTrim(sb.greedy.to(dev)) if k and self.trims else None

    def chain_table(self, inp: "BatchInputs", rows: torch.Tensor) -> torch.Tensor:
        """The rows' slot table, sliced once and shared by a chain's steps (max_kv > L + k: every
        chain position; in whole pages for page gathers)."""
        width = padded_width(inp.max_kv, self.runner.args.page_size)
        return self.runner.req_to_slot[:, :width].index_select(0, rows)

    def advance(self, rows: torch.Tensor, L: torch.Tensor, v: "Verified") -> None:
        """After acceptance: each row's cache holds n+1 more tokens and its bonus is the last emitted."""
        self.kv_len[rows] = L + v.n + 1
        self.bonus[rows] = v.emitted[torch.arange(rows.shape[0], device=rows.device), v.n]

    @abstractmethod
    def after_prefill(self, inp: "BatchInputs", input_ids: torch.Tensor, attn: "AttentionBatch",
                      out: "ModelOutput", sampled: torch.Tensor) -> None:
        """On the stream, after a prefill batch sampled: seed the rows whose prompt is now complete."""

    @abstractmethod
    def decode_step(self, inp: "BatchInputs") -> "StepResult":
        """On the stream: draft inp.chain tokens per row (0: none, a plain step under load), verify,
        accept, update state. Returns host tensors (emitted [B, chain+1], accepted drafts n [B],
        logprob tensors when asked, and the step's phase marks)."""

    def draft_kv_layout(self) -> tuple[int, int, int] | None:
        """(layers, kv_heads, head_dim) of the draft's own KV cache; None without a draft model."""
        return None

    def kv_bytes_per_slot(self) -> int:
        """Bytes of the draft's own KV per slot (0 without a draft model)."""
        layout = self.draft_kv_layout()
        return KVCache.bytes_per_slot(*layout, self.runner.dtype) if layout else 0

    def allocate_kv(self, num_slots: int) -> None:
        """Called once the runner has sized the cache: the draft's KV shares the target's slots."""
        layout = self.draft_kv_layout()
        if layout:
            layers, kv_heads, head_dim = layout
            self.draft_kv = KVCache.allocate(layers, num_slots, kv_heads, head_dim, self.runner.dtype,
                                             self.runner.device.torch_device, self.runner.args.page_size)


    def verify(self, inp: "BatchInputs", rows: torch.Tensor, L: torch.Tensor, drafts: torch.Tensor,
               draft_probs: Callable[[], torch.Tensor], capture_aux: bool = False,
               widths: torch.Tensor | None = None) -> "Verified":
        """The target reads [bonus, d_1..d_k] at positions L..L+k; accept greedily (or by rejection
        sampling against draft_probs() [B, k, V] for sampling rows). k = drafts.shape[1] may be 0:
        a plain decode step of the bonus token.

        widths [B] (only where the device reads its tensors for free): row b verifies only its first
        widths[b] drafts, so the forward reads sum(widths + 1) tokens instead of B * (k+1); sampling
        rows must keep k. Results keep the [B, k+1] grid; nothing past a row's width is accepted."""
        runner, k, sb = self.runner, drafts.shape[1], inp.sampling
        batch, dev = rows.shape[0], rows.device
        verify_ids = torch.cat([self.bonus[rows][:, None], drafts], dim=1)               # [B, k+1]
        grid = None
        if widths is None or int(widths.min()) == k:
            q_lens, tokens = torch.full_like(rows, k + 1), verify_ids.reshape(-1)
            greedy_drafts = drafts
        else:
            q_lens = widths + 1
            grid = (torch.arange(k + 1, device=dev)[None, :] < q_lens[:, None]).reshape(-1).nonzero().squeeze(1)
            tokens = verify_ids.reshape(-1)[grid]
            greedy_drafts = torch.where(torch.arange(k, device=dev)[None, :] < widths[:, None], drafts, -1)
        attn = build_attention_batch(q_lens, L + q_lens, rows, runner.req_to_slot, k + 1, inp.max_kv, runner.kv)
        out = runner.model(tokens, attn, capture_aux=capture_aux)
        logits = runner.model.compute_logits(out.hidden)
        vocab = logits.shape[-1]
        if grid is not None:                       # back on the grid; rows past a width stay 0 (never accepted)
            logits = logits.new_zeros(batch * (k + 1), vocab).index_copy_(0, grid, logits)
        logits = logits.view(batch, k + 1, vocab)
        emitted, n = verify_greedy(greedy_drafts, logits)
        if not sb.all_greedy:
            target_probs = filtered_probs(logits.reshape(batch * (k + 1), vocab), expand(sb, k + 1))
            uniform = seeded_noise((batch, k), sb, runner.generator, dev, kind="uniform", salt=20)
            exponential = seeded_noise((batch, vocab), sb, runner.generator, dev, salt=21)
            q = draft_probs() if k else target_probs.new_zeros(batch, 0, vocab)    # a plain step has no drafts
            sampled, n_sampled = verify_sampled(drafts, q, target_probs.view(batch, k + 1, vocab), uniform, exponential)
            emitted = torch.where(sb.greedy[:, None], emitted, sampled)
            n = torch.where(sb.greedy, n, n_sampled)
        return Verified(attn=attn, out=out, logits=logits, emitted=emitted, n=n, q_lens=q_lens)


@dataclasses.dataclass
class Verified:
    """A verify forward: its AttentionBatch and output over the verified tokens (row b's q_lens[b]
    tokens, flattened), the logits [B, k+1, V] and emitted tokens [B, k+1] on the grid, and the
    accepted drafts n [B]."""

    attn: "AttentionBatch"
    out: "ModelOutput"
    logits: torch.Tensor
    emitted: torch.Tensor
    n: torch.Tensor
    q_lens: torch.Tensor

    def flat_emitted(self) -> torch.Tensor:
        """The emitted tokens in the forward's flattened order (row b: its first q_lens[b])."""
        cols = torch.arange(self.emitted.shape[1], device=self.emitted.device)
        return self.emitted[cols[None, :] < self.q_lens[:, None]]

    def flat_index(self, cols: torch.Tensor) -> torch.Tensor:
        """Where grid position (b, cols[b]) of each row sits in the flattened order."""
        return torch.cumsum(self.q_lens, 0) - self.q_lens + cols


# A chain stops below this top-1 probability of the draft. On held-out text (24 prompts, k = 6)
# the embedded EAGLE head's drafts under 0.1 were accepted 44% of the time, those above 90%; a
# chain step costs ~0.2 of a target step and each verified draft ~0.07, so a draft that unlikely
# (and the chain behind it) costs more than it brings. Measured at concurrency 1: EAGLE k=4 went
# from 1.45x to 1.52x of none's output tok/s (bench/results/capped_chain.txt, eagle_trim.txt).
DRAFT_CONFIDENCE = 0.1


def top_choice(logits: torch.Tensor, with_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax of each row of draft logits, and its softmax probability when asked."""
    top_logit, top = logits.max(dim=-1)
    if not with_confidence:
        return top, None
    return top, 1.0 / torch.exp(logits - top_logit[:, None]).sum(dim=-1)


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

    def __init__(self, runner: "ModelRunner"):
        self.tokens = torch.zeros(runner.num_rows, runner.table_width, dtype=torch.long,
                                  device=runner.device.torch_device)

    def write_prefill(self, inp: "BatchInputs", input_ids: torch.Tensor, positions: torch.Tensor,
                      sampled: torch.Tensor) -> None:
        dev = input_ids.device
        token_rows = inp.rows.to(dev).repeat_interleave(inp.q_lens.to(dev), output_size=input_ids.shape[0])
        self.tokens[token_rows, positions] = input_ids
        if sampled.numel():
            last_chunks = inp.draft_next < 0                                   # host: the sequences that sampled
            self.tokens[inp.rows[last_chunks].to(dev), inp.kv_lens[last_chunks].to(dev)] = sampled

    def write_step(self, rows: torch.Tensor, L: torch.Tensor, emitted: torch.Tensor) -> None:
        positions = L[:, None] + 1 + torch.arange(emitted.shape[1], device=rows.device)
        self.tokens[rows[:, None], positions.clamp(max=self.tokens.shape[1] - 1)] = emitted


def expand(sb: SamplingBatch, times: int) -> SamplingBatch:
    """Repeat every row's sampling parameters `times` times (one per verify row)."""
    rep = lambda t: t.repeat_interleave(times, dim=0)  # noqa: E731
    return dataclasses.replace(sb, temperature=rep(sb.temperature), top_k=rep(sb.top_k), top_p=rep(sb.top_p),
                               min_p=rep(sb.min_p), greedy=rep(sb.greedy),
                               seeds=[s for s in sb.seeds for _ in range(times)],
                               positions=[p for p in sb.positions for _ in range(times)])


def create_spec_worker(algorithm: str, runner: "ModelRunner") -> SpecWorker:
    module, cls = ALGORITHMS[algorithm].split(":")
    return getattr(importlib.import_module(module), cls)(runner)
