"""Speculative decoding, device side: a worker owns the draft (a draft model and its KV cache,
or none) and the per-row speculative state on the device; it sees the target only through a
narrow handle (engine/step.py: Target). It is the model runner's decoding (engine/decoding.py;
what that adds around its steps: spec/decoder.py) and makes its CPU-side counterpart,
spec/policy.py.

Per-row device state, written by the step that produced it and read by the next (the device
runs steps in order, so the CPU never waits for it):

  kv_len[row]        tokens of the request in the KV cache (target and draft share slots)
  bonus[row]         the last emitted token, not yet in the cache (fed first by the next verify)

Every worker's decode step has one shape (decode_step): draft a chain, verify it with the
target, let the draft read what was verified (extend), advance the state.

With graphs (devices/graphs.py) the verify replays the target's captured verify when the step's
inputs name one (inp.graph), and the draft's forwards replay the worker's own captured steps
(spec/draft_graphs.py); chains then keep their full length (no per-row trimming: fixed shapes).
"""
from __future__ import annotations

import dataclasses
import importlib
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from engine.models.attention import KVCache, build_attention_batch, padded_width
from engine.sampling import SamplingBatch, filtered_probs, seeded_noise
from engine.step import StepInputs, StepResult, Target, step_result
from spec.arrivals import Arrivals
from spec.chains import Chain, ConfidenceTrim, expand
from spec.decoder import SpecDecoder
from engine.grammar_masks import mask_chain, settle_chain
from spec.verify import verify_greedy, verify_sampled

if TYPE_CHECKING:
    from engine.args import ServerArgs
    from engine.models.attention import AttentionBatch
    from engine.models.base import ModelOutput

ALGORITHMS = {
    "eagle": "spec.eagle_worker:EagleWorker",
    "eagle3": "spec.eagle_worker:EagleWorker",
    "standalone": "spec.standalone_worker:StandaloneWorker",
    "ngram": "spec.ngram_worker:NgramWorker",
}


@dataclasses.dataclass
class Verified:
    """A verify forward: its AttentionBatch (None: a captured verify) and output over the verified
    tokens (row b's q_lens[b] tokens, flattened), the logits [B, k+1, V] and emitted tokens [B, k+1]
    on the grid, the accepted drafts n [B] and the tokens the forward read."""

    attn: "AttentionBatch | None"
    out: "ModelOutput"
    logits: torch.Tensor
    emitted: torch.Tensor
    n: torch.Tensor
    q_lens: torch.Tensor
    tokens: int

    @property
    def whole_chains(self) -> bool:
        """Every row verified the whole chain (the grid and the flattened order are the same)."""
        return self.tokens == self.emitted.numel()

    def flat_emitted(self) -> torch.Tensor:
        """The emitted tokens in the forward's flattened order (row b: its first q_lens[b]). Whole chains
        (always where the host's reads are not free) need no mask: a mask's index waits for the device."""
        if self.whole_chains:
            return self.emitted.reshape(-1)
        cols = torch.arange(self.emitted.shape[1], device=self.emitted.device)
        return self.emitted[cols[None, :] < self.q_lens[:, None]]

    def flat_index(self, cols: torch.Tensor) -> torch.Tensor:
        """Where grid position (b, cols[b]) of each row sits in the flattened order."""
        return torch.cumsum(self.q_lens, 0) - self.q_lens + cols


class SpecWorker(SpecDecoder):
    draft_weights: str | None = None     # the draft model's quantization (draft_quantization)

    def __init__(self, args: "ServerArgs", target: Target):
        super().__init__(args, target)
        rows, dev = target.num_rows, target.torch_device
        self.kv_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.bonus = torch.zeros(rows, dtype=torch.long, device=dev)
        # chains are trimmed per row (ConfidenceTrim, verify's widths) only where that costs no sync, and
        # not with graphs (whole chains: the shapes they captured)
        self.trims = target.device.free_host_reads and target.graphs is None
        self.arrivals = Arrivals()

    def describe(self) -> str:
        """For the start-up log line."""
        text = f"{self.args.spec_algorithm}, {self.args.num_steps} steps"
        return text + (f", {self.draft_weights} draft weights" if self.draft_weights else "")

    # ---- one speculative step --------------------------------------------------------

    def decode_step(self, inp: StepInputs) -> StepResult:
        """On the stream: draft inp.spec.chain tokens per row (0: none, a plain step under load),
        verify, accept, let the draft read the verified tokens, update the state."""
        rows = inp.rows.to(self.target.torch_device)
        L, marks = self.kv_len[rows], [("start", self.target.device.mark())]
        chain = self.draft(inp, rows, L)
        self.mark("draft", marks)
        v = self.verify(inp, rows, L, chain)
        self.mark("verify", marks)
        self.extend(inp, rows, L, v, marks)
        self.advance(rows, L, v)
        drafted = chain.widths if chain.widths is not None else torch.full_like(rows, chain.drafts.shape[1])
        return step_result(v.emitted, v.n, v.logits, inp.sampling, marks=marks,
                           drafted=drafted.to("cpu", non_blocking=True), verify_tokens=v.tokens)

    @abstractmethod
    def draft(self, inp: StepInputs, rows: torch.Tensor, L: torch.Tensor) -> Chain:
        """Propose up to inp.spec.chain drafts per row (fewer where the chain is trimmed)."""

    def extend(self, inp: StepInputs, rows: torch.Tensor, L: torch.Tensor, v: Verified, marks: list) -> None:
        """After verification: the draft reads what was verified (EAGLE: its extend phase)."""

    def mark(self, phase: str, marks: list) -> None:
        """Record the end of a phase (draft, verify, extend) of the step being launched."""
        marks.append((phase, self.target.device.mark()))

    def chain_trim(self, inp: StepInputs, k: int, dev: torch.device) -> ConfidenceTrim | None:
        """The per-row trimming of this step's chain of k drafts, where chains are trimmed."""
        return ConfidenceTrim(inp.sampling.greedy.to(dev)) if k and self.trims and inp.spec.trim else None

    def chain_table(self, inp: StepInputs, rows: torch.Tensor) -> torch.Tensor:
        """The rows' slot table, sliced once and shared by a chain's steps (max_kv > L + k: every
        chain position; in whole pages for page gathers)."""
        width = padded_width(inp.max_kv, self.target.page_size)
        return self.target.req_to_slot[:, :width].index_select(0, rows)

    def rows_ended(self, inp: StepInputs) -> bool:
        """Has every row of the step emitted all its request may (its length cap, a host read)? The
        bonus token, at position kv_len, is the last emitted: the length so far is kv_len + 1."""
        cap = inp.spec.length_cap
        return cap is not None and bool((self.kv_len[inp.rows.to(self.kv_len.device)] + 1 >= cap.to(
            self.kv_len.device)).all())

    def advance(self, rows: torch.Tensor, L: torch.Tensor, v: Verified) -> None:
        """After acceptance: each row's cache holds n+1 more tokens and its bonus is the last emitted."""
        self.kv_len[rows] = L + v.n + 1
        self.bonus[rows] = v.emitted[torch.arange(rows.shape[0], device=rows.device), v.n]

    def seed_sampled_rows(self, inp: StepInputs, sampled: torch.Tensor) -> torch.Tensor:
        """After a prefill: the rows whose prompt is now complete (those that sampled) start
        speculating at L = their prompt length with bonus = the sampled token. Returns the rows."""
        last_chunks = inp.spec.draft_next < 0                                  # host: the sequences that sampled
        rows = inp.rows[last_chunks].to(sampled.device)
        self.kv_len[rows] = inp.kv_lens[last_chunks].to(sampled.device)
        self.bonus[rows] = sampled
        return rows

    # ---- verification ----------------------------------------------------------------

    def verify(self, inp: StepInputs, rows: torch.Tensor, L: torch.Tensor, chain: Chain) -> Verified:
        """The target reads [bonus, d_1..d_k] at positions L..L+k; accept greedily (or by rejection
        sampling against chain.probs() [B, k, V] for sampling rows). k may be 0: a plain step.

        chain.widths [B] (only where the device reads its tensors for free): row b verifies only its
        first widths[b] drafts, so the forward reads sum(widths + 1) tokens instead of B * (k+1);
        sampling rows keep k. Results keep the [B, k+1] grid; nothing past a row's width is accepted.
        With inp.graph, the forward is the target's captured verify (attn is then None)."""
        k, target = chain.drafts.shape[1], self.target
        if inp.graph is not None:
            return self.verify_captured(inp, rows, L, chain)
        tokens, q_lens, grid, greedy_drafts = verify_layout(self.bonus[rows], chain)
        attn = build_attention_batch(q_lens, L + q_lens, rows, target.req_to_slot, k + 1, inp.max_kv, target.kv,
                                     tokens=tokens.shape[0])
        out = target.model(tokens, attn, capture_aux=self.needs_aux)
        logits = target.model.compute_logits(out.hidden)
        if grid is not None:                       # back on the grid; rows past a width stay 0 (never accepted)
            logits = logits.new_zeros(rows.shape[0] * (k + 1), logits.shape[-1]).index_copy_(0, grid, logits)
        logits = logits.view(rows.shape[0], k + 1, logits.shape[-1])
        emitted, n = self.accept(inp.sampling, chain, greedy_drafts, logits)
        return Verified(attn=attn, out=out, logits=logits, emitted=emitted, n=n, q_lens=q_lens,
                        tokens=tokens.shape[0])

    def verify_captured(self, inp: StepInputs, rows: torch.Tensor, L: torch.Tensor, chain: Chain) -> Verified:
        """verify through the target's captured verify: every row reads its whole chain."""
        k = chain.drafts.shape[1]
        if chain.widths is not None or k != inp.graph.chain:
            raise RuntimeError(f"a captured verify of chain {inp.graph.chain} got {k} drafts (trimmed: "
                               f"{chain.widths is not None})")
        tokens = torch.cat([self.bonus[rows][:, None], chain.drafts], dim=1)                 # [B, k+1]
        logits, out = self.target.graphs.verify_forward(inp.graph, tokens, L, rows)
        emitted, n = self.accept(inp.sampling, chain, chain.drafts, logits)
        return Verified(attn=None, out=out, logits=logits, emitted=emitted, n=n,
                        q_lens=torch.full_like(rows, k + 1), tokens=tokens.numel())

    def accept(self, sb: SamplingBatch, chain: Chain, greedy_drafts: torch.Tensor,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The emitted tokens [B, k+1] and accepted drafts [B] of a verify's logits [B, k+1, V]; constrained
        rows' logits are masked along their chains first (engine/grammar_masks.py)."""
        walked = mask_chain(logits, greedy_drafts, sb.grammars)
        emitted, n = verify_greedy(greedy_drafts, logits)
        if not sb.all_greedy:
            emitted, n = self.accept_sampled(sb, chain, logits, emitted, n)
        settle_chain(emitted, n, sb.grammars, walked)
        return emitted, n

    def accept_sampled(self, sb: SamplingBatch, chain: Chain, logits: torch.Tensor, emitted: torch.Tensor,
                       n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling for the sampling rows (greedy rows keep their greedy acceptance)."""
        batch, width, vocab = logits.shape
        k, dev, generator = width - 1, logits.device, self.target.generator
        target_probs = filtered_probs(logits.reshape(batch * width, vocab), expand(sb, width))
        uniform = seeded_noise((batch, k), sb, generator, dev, kind="uniform", salt=20)
        exponential = seeded_noise((batch, vocab), sb, generator, dev, salt=21)
        q = chain.probs() if k else target_probs.new_zeros(batch, 0, vocab)    # a plain step has no drafts
        sampled, n_sampled = verify_sampled(chain.drafts, q, target_probs.view(batch, width, vocab), uniform,
                                            exponential)
        return torch.where(sb.greedy[:, None], emitted, sampled), torch.where(sb.greedy, n, n_sampled)

    # ---- the draft's own KV cache ------------------------------------------------------

    def draft_kv_layout(self) -> tuple[int, int, int] | None:
        """(layers, kv_heads, head_dim) of the draft's own KV cache; None without a draft model."""
        return None

    def kv_bytes_per_slot(self) -> int:
        """Bytes of the draft's own KV per slot (0 without a draft model)."""
        layout = self.draft_kv_layout()
        return KVCache.bytes_per_slot(*layout, self.target.dtype) if layout else 0

    def allocate_kv(self, num_slots: int) -> None:
        """Called once the runner has sized the cache: the draft's KV shares the target's slots."""
        layout = self.draft_kv_layout()
        if layout:
            layers, kv_heads, head_dim = layout
            self.draft_kv = KVCache.allocate(layers, num_slots, kv_heads, head_dim, self.target.dtype,
                                             self.target.torch_device, self.target.page_size)

    # ---- a request's state, exported and imported ---------------------------------------

    def export_row(self, row: int) -> dict[str, torch.Tensor]:
        """Per-row draft state beyond kv_len and bonus (which follow from the request), on the host."""
        return {}

    def import_row(self, row: int, state: dict[str, Any], token_ids: list[int], kv_len: int) -> None:
        """Continue a request exported elsewhere: its tokens (prompt and outputs; the last is the
        bonus at position kv_len) and its exported row state."""
        self.kv_len[row] = kv_len
        self.bonus[row] = token_ids[kv_len]


def verify_layout(bonus: torch.Tensor, chain: Chain) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              torch.Tensor]:
    """The verify forward's tokens, per-row query lengths, their places on the [B, k+1] grid (None:
    every place) and the drafts greedy acceptance compares (-1 past a row's width)."""
    drafts, widths = chain.drafts, chain.widths
    k, dev = drafts.shape[1], drafts.device
    verify_ids = torch.cat([bonus[:, None], drafts], dim=1)                      # [B, k+1]
    if widths is None or int(widths.min()) == k:
        return verify_ids.reshape(-1), torch.full_like(bonus, k + 1), None, drafts
    q_lens = widths + 1
    grid = (torch.arange(k + 1, device=dev)[None, :] < q_lens[:, None]).reshape(-1).nonzero().squeeze(1)
    greedy_drafts = torch.where(torch.arange(k, device=dev)[None, :] < widths[:, None], drafts, -1)
    return verify_ids.reshape(-1)[grid], q_lens, grid, greedy_drafts


def draft_quantization(args: "ServerArgs", target: Target) -> str | None:
    """--speculative-draft-quantization resolved. auto: a draft step reads the head's weights for a few
    rows, so fewer bytes a weight pay wherever the native kernels run it: w8a8_int8 where they take its
    integer sums in hardware, else weight-only int8; without the kernels, as --quantization (docs/
    performance-history.md has the side-by-side figures)."""
    choice = args.speculative_draft_quantization
    if choice == "auto":
        kernels = getattr(target.model, "kernels", None)
        if kernels is None:
            return args.quantization
        return "w8a8_int8" if kernels.product_path("w8a8_int8") != "portable vectors" else "int8"
    return None if choice == "none" else choice


def create_spec_worker(args: "ServerArgs", target: Target) -> SpecWorker:
    module, cls = ALGORITHMS[args.spec_algorithm].split(":")
    return getattr(importlib.import_module(module), cls)(args, target)
