"""Standalone drafting: a small causal LM with the target's tokenizer proposes a chain,
on the stream (fixed shapes where the device needs them).

The draft is an ordinary LM (draft position t reads token t) with its own KV cache,
indexed by the same slot table as the target. A step for B decoding requests
(k = inp.chain; L = kv_len[row]; b = bonus[row]; lag = plain steps the draft skipped):

  draft    forward 1 reads the history at positions L-1-lag .. L (its last token is b)
           and proposes d_1; forward i = 2..k reads d_{i-1} at L+i-1 and proposes d_i
  trim     where the device reads its tensors for free (the CPU), a greedy row verifies its
           drafts up to the first the draft gives probability < DRAFT_CONFIDENCE (w_b of
           them; sampled rows keep k), and the chain stops where no row goes on (w = max w_b)
  verify   the target reads [b, d_1..d_wb] at positions L..L+w_b   (one forward of sum(w_b+1) rows)
  accept   n leading drafts match; emitted = the n drafts + the target's token after them
  state    kv_len += n+1, bonus = emitted_n, the history gets the emitted tokens

Invariant at the start of a drafting step: the draft KV holds the request's tokens at
every position < L-1-lag. Forwards fed b, d_1..d_{w-1} at L..L+w-1 (and d_w at L+w when
the chain was trimmed after it), and the accepted tokens at L..L+n (n <= w_b <= w) are
exactly b, d_1..d_n, so after acceptance positions < L+n are right; when n == k, position
L+k (d_k) was never fed. Re-reading the token at L-1 in the next
step's first forward covers both cases without the CPU knowing n (a correct entry is
just rewritten). A plain step (k == 0, under load) runs no draft and emits exactly one
token, so the CPU knows how far each draft lags (SeqWork.draft_lag). A prefill runs the
draft over the same chunk, leaving positions < L right, except under load (inp.draft_skip),
when the draft reads nothing and the scheduler counts the prompt's tail into draft_lag.

With graphs, an all-greedy chain whose draft lags nowhere (lag == 0: forward 1 reads L-1 and L)
replays a captured step (spec/draft_graphs.py).
"""
from __future__ import annotations


import torch

from engine.models.attention import build_attention_batch, chain_step_batch
from engine.models.loader import load_model
from engine.sampling import SamplingBatch, filtered_probs, seeded_noise
from spec.base import SpecWorker, Verified, draft_quantization
from spec.chains import Chain, TokenHistory, greedy_chain, stack_chain, top_choice
from spec.draft_graphs import StandaloneGraphs


class StandaloneWorker(SpecWorker):
    catches_up = True          # draft_lag: plain steps and skipped prompt chunks

    def __init__(self, args, target):
        super().__init__(args, target)
        path = args.draft_model_path
        self.draft_weights = draft_quantization(args, target)
        self.draft_model, config = load_model(path, target.dtype, target.torch_device, args.cpu_kernels,
                                              self.draft_weights)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path} has vocab_size {config.vocab_size}, the target "
                             f"{args.model_path} has {target.vocab_size}: a standalone draft must "
                             f"share the target's tokenizer")
        self.history = TokenHistory(target)
        self.graphs = StandaloneGraphs(self) if target.graphs else None

    def draft_kv_layout(self) -> tuple[int, int, int]:
        return self.draft_model.kv_layout()

    def propose(self, hidden: torch.Tensor, sb: SamplingBatch,
                salt: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Draft output rows -> draft tokens, q (the draft's filtered distribution) when any row
        samples, and the draft's top-1 probability of each row where chains are trimmed."""
        logits = self.draft_model.compute_logits(hidden)
        greedy, confidence = top_choice(logits, self.trims, self.draft_model.kernels)
        if sb.all_greedy:
            return greedy, None, confidence
        q = filtered_probs(logits, sb)
        noise = seeded_noise(tuple(q.shape), sb, self.target.generator, q.device, salt=salt)
        return torch.where(sb.greedy, greedy, (q / noise).argmax(dim=-1)), q, confidence

    # ---- prefill -------------------------------------------------------------------

    def after_prefill(self, inp, input_ids, attn, out, sampled) -> None:
        if not inp.spec.draft_skip:                            # under load: caught up when drafting resumes
            self.draft_model(input_ids, attn.with_kv(self.draft_kv))
        self.history.write_prefill(inp, input_ids, attn.positions, sampled)
        self.seed_sampled_rows(inp, sampled)

    # ---- one speculative step ------------------------------------------------------

    def catch_up(self, inp, rows: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        """Draft forward over positions L-1-lag .. L of every row; the draft's output at L [B, H]."""
        dev, lag = rows.device, inp.spec.draft_lag
        q_lens = lag.to(dev) + 2
        max_q = int(lag.max()) + 2 if lag.numel() else 2                          # host tensor: no sync
        tokens = int(lag.sum()) + 2 * lag.numel()                                # host tensor: no sync
        attn = build_attention_batch(q_lens, L + 1, rows, self.target.req_to_slot, max_q, inp.max_kv, self.draft_kv,
                                     tokens=tokens)
        token_rows = rows.repeat_interleave(q_lens, output_size=tokens)
        out = self.draft_model(self.history.tokens[token_rows, attn.positions], attn)
        return out.hidden[torch.cumsum(q_lens, 0) - 1]

    def propose_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft output rows -> greedy draft tokens: propose's choice for greedy rows."""
        return top_choice(self.draft_model.compute_logits(hidden), False, self.draft_model.kernels)[0]

    def draft(self, inp, rows: torch.Tensor, L: torch.Tensor) -> Chain:
        k, sb = inp.spec.chain, inp.sampling
        if self.graphs and k and sb.all_greedy and not bool(inp.spec.draft_lag.any()) \
                and self.graphs.draft.can_run(rows.shape[0]):                       # draft_lag: a host tensor
            recent = self.history.tokens[rows[:, None], L[:, None] + torch.arange(-1, 1, device=rows.device)]
            return greedy_chain(self.graphs.draft.run(rows.shape[0], (k, self.target.key_width(inp.max_kv)),
                                                      recent=recent, first_pos=L, rows=rows)["drafts"])
        drafts, qs = [], []
        trim = self.chain_trim(inp, k, rows.device)
        if k:
            token, q, confidence = self.propose(self.catch_up(inp, rows, L), sb, salt=1)
            if trim and not trim.keep(confidence):
                k = 0                                           # no row believes its first draft
            else:
                drafts, qs = [token], [q]
        table = self.chain_table(inp, rows) if k > 1 else None
        for i in range(2, k + 1):
            attn = chain_step_batch(L + (i - 1), table, self.draft_kv)
            token, q, confidence = self.propose(self.draft_model(drafts[-1], attn).hidden, sb, salt=i)
            if trim and not trim.keep(confidence):
                break                                           # no row verifies d_i: the chain ends
            drafts.append(token)
            qs.append(q)
        return stack_chain(drafts, qs, rows, trim.widths() if trim else None)

    def extend(self, inp, rows: torch.Tensor, L: torch.Tensor, v: Verified, marks: list) -> None:
        self.history.write_step(rows, L, v.emitted)

    # ---- a request's state ------------------------------------------------------------

    def import_row(self, row: int, state, token_ids: list[int], kv_len: int) -> None:
        super().import_row(row, state, token_ids, kv_len)
        self.history.write_known(row, token_ids)
