"""EAGLE / EAGLE-3 chain drafting, on the stream (fixed shapes where the device needs them).

A step for B decoding requests (k = inp.spec.chain: num_steps, or 0 for a plain step under load;
L = kv_len[row]; b = bonus[row]):

  draft    d_1 comes from the previous extend; for i = 2..k the head reads (d_{i-1}, g)
           at position L+i-2 and proposes d_i                       (k-1 forwards of B rows)
  trim     where the device reads its tensors for free (the CPU), a greedy row verifies its
           drafts up to the first one its head gives probability < DRAFT_CONFIDENCE (w_b of
           them), and the chain ends where no row verifies the next draft (before d_1: the step
           verifies the bonus alone). Greedy output does not depend on w_b; sampled rows keep
           k, so a seeded request does not depend on what it is batched with. Elsewhere w_b = k.
  verify   the target reads [b, d_1..d_wb] at positions L..L+w_b   (one forward of sum(w_b+1) rows)
  accept   n leading drafts match; emitted = the n drafts + the target's token after them
  extend   the head reads (emitted_i, f_i) at positions L..L+w_b of every row, and row b's
           output at position L+n gives the next step's g and d_1
  state    kv_len += n+1, bonus = emitted_n

Draft position t reads token t+1 and the target's feature at t, so after a prefill of
P tokens the extend reads prompt[1:] + [sampled token].

With graphs, an all-greedy chain (k >= 2) and the extend replay captured steps (spec/draft_graphs.py).

Per-row head state, besides kv_len and bonus: draft_hidden (g) and draft_first (d_1) with its
confidence and, for sampling rows, its distribution q. With the head's KV of the positions before
kv_len, that is what a request takes along to continue elsewhere (export_row / import_row).
"""
from __future__ import annotations

import math

import torch

from engine.models.attention import chain_step_batch
from engine.models.loader import load_draft
from engine.sampling import SamplingBatch, filtered_probs, seeded_noise
from spec.base import SpecWorker, Verified, draft_quantization
from spec.chains import DRAFT_CONFIDENCE, Chain, ConfidenceTrim, greedy_chain, stack_chain, top_choice
from spec.draft_graphs import EagleGraphs

ROW_STATE = ("draft_first", "draft_hidden", "first_confidence", "first_probs")


class EagleWorker(SpecWorker):
    # A head reads the target's features, which are gone after the step: what it skips it cannot catch up
    # on, so a request whose positions it skipped (inp.spec.draft_skip) decodes plainly to its end.
    falls_behind = True
    # Head position t reads token t+1: the prefix cache keys a page with the token after it (engine/radix_cache.py).
    draft_lookahead = 1

    def __init__(self, args, target):
        super().__init__(args, target)
        dev = target.torch_device
        self.draft_weights = draft_quantization(args, target)
        self.head, _ = load_draft(args.draft_model_path, target.model, target.dtype, dev,
                                  token_map=args.token_map_path, cpu_kernels=args.cpu_kernels,
                                  quantization=self.draft_weights)
        self.needs_aux = getattr(self.head, "aux_hidden_state_layer_ids", None) is not None
        rows, vocab = target.num_rows, target.vocab_size
        self.draft_first = torch.zeros(rows, dtype=torch.long, device=dev)
        self.draft_hidden = torch.zeros(rows, self.head.hidden_size, dtype=target.dtype, device=dev)
        self.first_probs = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)
        self.first_confidence = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.draft_ids = self.head.draft_to_target(torch.arange(self.head.compute_logits(
            torch.zeros(1, self.head.hidden_size, dtype=target.dtype, device=dev)).shape[-1], device=dev))
        self.graphs = EagleGraphs(self) if target.graphs else None

    def describe(self) -> str:
        hot = self.head.hot_ids
        native = self.draft_kv is not None and self.head.native_chain_parts(self.draft_kv) is not None
        return (super().describe() + (f", token map of {hot.numel()} / {self.target.vocab_size} tokens"
                                      if hot is not None else "")
                + (", greedy chains and extends in one native call each" if native and not self.graphs else ""))

    def draft_kv_layout(self) -> tuple[int, int, int]:
        return self.head.kv_layout()

    # ---- drafting ------------------------------------------------------------------

    def propose(self, hidden: torch.Tensor, sb: SamplingBatch,
                salt: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Head output rows -> draft tokens (target ids), q over the target vocab when any row
        samples (else None), and the head's top-1 probability of each row (None where chains are not trimmed)."""
        logits = self.head.compute_logits(hidden)
        top, confidence = top_choice(logits, self.trims, self.head.kernels)
        greedy = self.head.draft_to_target(top)
        if sb.all_greedy:
            return greedy, None, confidence
        q_draft = filtered_probs(logits, sb)
        q = torch.zeros(q_draft.shape[0], self.target.vocab_size, device=q_draft.device)
        q[:, self.draft_ids] = q_draft
        noise = seeded_noise(tuple(q.shape), sb, self.target.generator, q.device, salt=salt)
        sampled = (q / noise).argmax(dim=-1)
        return torch.where(sb.greedy, greedy, sampled), q, confidence

    def seed_rows(self, rows: torch.Tensor, g: torch.Tensor, sb: SamplingBatch, salt: int) -> None:
        first, q, confidence = self.propose(g, sb, salt)
        self.draft_first[rows] = first
        if confidence is not None:
            self.first_confidence[rows] = confidence
        self.draft_hidden[rows] = g.to(self.draft_hidden.dtype)
        if q is not None:
            self.first_probs[rows] = q

    def propose_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head output rows -> greedy draft tokens (target ids): propose's choice for greedy rows."""
        return self.head.draft_to_target(top_choice(self.head.compute_logits(hidden), False, self.head.kernels)[0])

    def draft(self, inp, rows: torch.Tensor, L: torch.Tensor) -> Chain:
        k, sb = inp.spec.chain, inp.sampling
        if self.graphs and k > 1 and sb.all_greedy and self.graphs.draft.can_run(rows.shape[0]):
            return greedy_chain(self.graphs.draft.run(
                rows.shape[0], (k, self.target.key_width(inp.max_kv)), first=self.draft_first[rows],
                hidden=self.draft_hidden[rows], first_pos=L, rows=rows)["drafts"])
        trim = self.chain_trim(inp, k, rows.device)
        if trim and not trim.keep(self.first_confidence[rows]):
            k = 0                                               # no row believes its first draft
        first, g = self.draft_first[rows], self.draft_hidden[rows]
        table = self.chain_table(inp, rows) if k > 1 else None
        if k > 1 and sb.all_greedy:
            chain = self.native_chain(first, g, L, table, k, trim)
            if chain is not None:
                return chain
        drafts = [first][:k]
        qs = [None if sb.all_greedy else self.first_probs[rows]][:k]       # q only matters when sampling
        for i in range(2, k + 1):
            g = self.head(drafts[-1], g, chain_step_batch(L + (i - 2), table, self.draft_kv))
            token, q, confidence = self.propose(g, sb, salt=1 + i)
            if trim and not trim.keep(confidence):
                break                                           # no row verifies d_i: the chain ends
            drafts.append(token)
            qs.append(q)
        return stack_chain(drafts, qs, rows, trim.widths() if trim else None)

    def native_chain(self, first: torch.Tensor, g: torch.Tensor, L: torch.Tensor, table: torch.Tensor, k: int,
                     trim: ConfidenceTrim | None) -> Chain | None:
        """draft's loop for an all-greedy batch in one call, where the head has one (draft_chain)."""
        keep = trim.kept[-1] if trim else torch.ones_like(first, dtype=torch.bool)
        chain = self.head.draft_chain(first, g, L, table, self.draft_kv, k - 1, keep,
                                      DRAFT_CONFIDENCE if trim else -math.inf)
        if chain is None:
            return None
        drafts, kept = chain
        if trim:
            trim.kept.extend(kept.unbind(0))
        return greedy_chain(drafts, trim.widths() if trim else None)

    def extend(self, inp, rows: torch.Tensor, L: torch.Tensor, v: Verified, marks: list) -> None:
        """The head reads every verified token (a plain step, w == 0, still extends by one) and row
        b's output at its last accepted position seeds the next step."""
        features = v.out.aux_hidden if self.needs_aux else v.out.hidden
        batch, per_row = v.emitted.shape
        if self.graphs and v.whole_chains and self.graphs.extend.can_run(batch):
            g = self.graphs.extend.run(batch, (per_row - 1, self.target.key_width(inp.max_kv)), tokens=v.emitted,
                                       features=features.view(batch, per_row, -1), accepted=v.n, first_pos=L,
                                       rows=rows)["hidden"]
        elif inp.sampling.all_greedy and self.native_extend(rows, v, features):
            self.mark("extend", marks)
            return
        else:
            g_all = self.head(v.flat_emitted(), features, v.attn.with_kv(self.draft_kv))
            g = g_all[v.flat_index(v.n)]
        self.seed_rows(rows, g, inp.sampling, salt=30)
        self.mark("extend", marks)

    def native_extend(self, rows: torch.Tensor, v: Verified, features: torch.Tensor) -> bool:
        """extend and seed_rows for an all-greedy batch in one call, where the head has one
        (extend_native): False where it has not, and nothing was done."""
        out = self.head.extend_native(v.flat_emitted(), features, v.attn.with_kv(self.draft_kv), v.flat_index(v.n))
        if out is None:
            return False
        g, first, confidence = out
        self.draft_first[rows] = first              # target ids: a head with a token map has no native call
        if self.trims:
            self.first_confidence[rows] = confidence
        self.draft_hidden[rows] = g.to(self.draft_hidden.dtype)
        return True

    # ---- prefill -------------------------------------------------------------------

    def after_prefill(self, inp, input_ids, attn, out, sampled) -> None:
        if inp.spec.draft_skip:                 # its requests are behind for good: they never draft again
            self.seed_sampled_rows(inp, sampled)
            return
        dev = sampled.device
        last = torch.cumsum(inp.q_lens.to(dev), 0) - 1                         # last token of each seq
        next_ids = torch.roll(input_ids, -1)
        # the sampling seqs (the last chunks), known on the host: indices, as a mask would have to be counted there
        samples = (inp.spec.draft_next < 0).nonzero().squeeze(1).to(dev)
        after = inp.spec.draft_next.to(dev, copy=True)  # copy: draft_next itself stays the host's record
        after[samples] = sampled
        next_ids[last] = after
        features = out.aux_hidden if self.needs_aux else out.hidden
        g_all = self.head(next_ids, features, attn.with_kv(self.draft_kv))
        rows = self.seed_sampled_rows(inp, sampled)
        self.seed_rows(rows, g_all[last[samples]], inp.sampling, salt=1)

    # ---- a request's state ------------------------------------------------------------

    def export_row(self, row: int) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name)[row].to("cpu") for name in ROW_STATE}

    def import_row(self, row: int, state, token_ids: list[int], kv_len: int) -> None:
        super().import_row(row, state, token_ids, kv_len)
        for name in ROW_STATE:
            getattr(self, name)[row] = state[name].to(self.target.torch_device)
