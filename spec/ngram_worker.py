"""N-gram drafting: no draft model; the drafts are what followed the most recent earlier
occurrence of the request's last few tokens (prompt lookup), found on the device.

The drafts come from the per-row token history on the device (spec.base.TokenHistory).

A step for B decoding requests (k = inp.chain; L = kv_len[row]; N = L+1 valid tokens):

  draft    for m = 3, 2, 1: the latest start j <= N-1-m with tokens[j:j+m] equal to the last
           m tokens; the longest m that matches wins. With f = j+m and period p = N-f, propose
           tokens[f + (i mod p)] for i < k (the continuation, repeated periodically once it
           reaches the suffix). No match: propose the last token k times.
  trim     where the device reads its tensors for free (the CPU), a greedy row verifies only
           the drafts worth checking, w_b: none without a match, SINGLE_TOKEN_MATCH_DRAFTS after
           a 1-token match, k after a longer one. Greedy output does not depend on w_b; sampled
           rows keep k, so a seeded request does not depend on what it is batched with.
  verify   the target reads [b, d_1..d_w] at positions L..L+w (w = w_b, or k); greedy, or
           rejection sampling with q = one-hot at each draft (a deterministic proposal is a valid q)
  state    kv_len += n+1, bonus = emitted_n, history gets the emitted tokens
"""
from __future__ import annotations

import torch

from spec.base import SpecWorker, Verified
from spec.chains import Chain, TokenHistory

MATCH_LENGTHS = (3, 2, 1)      # suffix lengths tried, longest first
# Drafts worth verifying after a match of one token: a one-token match rarely predicts more than the
# next token or two (docs/performance-history.md: per-row chain trimming).
SINGLE_TOKEN_MATCH_DRAFTS = 3


def ngram_drafts(history: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """history [B, W] tokens, of which the first valid[b] (>= 1) are real -> (draft tokens [B, k],
    drafts worth verifying [B]: 0 without a match, fewer after a one-token match, else k)."""
    batch, width = history.shape
    dev = history.device
    follow = valid - 1                                            # no match: period 1 on the last token
    found = torch.zeros(batch, dtype=torch.bool, device=dev)
    matched = torch.zeros(batch, dtype=torch.long, device=dev)
    for m in MATCH_LENGTHS:
        if m >= width:
            continue
        suffix_pos = (valid[:, None] - m + torch.arange(m, device=dev)).clamp(min=0)
        suffix = history.gather(1, suffix_pos)                                     # [B, m]
        match = (history.unfold(1, m, 1) == suffix[:, None, :]).all(dim=-1)        # [B, W-m+1]
        starts = torch.arange(width - m + 1, device=dev)
        match &= starts[None, :] <= (valid - 1 - m)[:, None]                       # an earlier occurrence
        latest = torch.where(match, starts, -1).amax(dim=-1)                       # [B]; -1: none
        hit = (latest >= 0) & ~found
        follow = torch.where(hit, latest + m, follow)
        matched = torch.where(hit, m, matched)
        found |= hit
    period = valid - follow                                                         # >= 1
    index = follow[:, None] + torch.arange(k, device=dev)[None, :] % period[:, None]
    worth = torch.where(matched > 1, k, torch.where(matched == 1, min(k, SINGLE_TOKEN_MATCH_DRAFTS), 0))
    return history.gather(1, index), worth


class NgramWorker(SpecWorker):
    reads_tokens = True        # the history: a prompt read from the prefix cache brings its cached tokens

    def __init__(self, args, target):
        super().__init__(args, target)
        self.history = TokenHistory(target)

    # ---- prefill -------------------------------------------------------------------

    def after_prefill(self, inp, input_ids, attn, out, sampled) -> None:
        for row, tokens in inp.spec.cached_tokens:
            self.history.write_known(row, tokens)
        self.history.write_prefill(inp, input_ids, attn.positions, sampled)
        self.seed_sampled_rows(inp, sampled)

    # ---- one speculative step ------------------------------------------------------

    def draft(self, inp, rows: torch.Tensor, L: torch.Tensor) -> Chain:
        k, batch, dev = inp.spec.chain, rows.shape[0], rows.device
        tokens = self.history.tokens
        width = min(inp.max_kv, tokens.shape[1])           # max_kv >= L+k+1 > every valid position
        drafts, worth = ngram_drafts(tokens[rows, :width], L + 1, k)               # [B, k], [B]
        widths = None
        if k and self.trims and inp.spec.trim:                                      # trim
            widths = torch.where(inp.sampling.greedy.to(dev), worth, k)
            drafts = drafts[:, :int(widths.max())]
        vocab = self.target.vocab_size
        def one_hot() -> torch.Tensor:          # q of a deterministic proposal
            return torch.zeros(batch, drafts.shape[1], vocab, device=dev).scatter_(-1, drafts[..., None], 1.0)
        return Chain(drafts, one_hot, widths)

    def extend(self, inp, rows: torch.Tensor, L: torch.Tensor, v: Verified, marks: list) -> None:
        self.history.write_step(rows, L, v.emitted)

    # ---- a request's state ------------------------------------------------------------

    def import_row(self, row: int, state, token_ids: list[int], kv_len: int) -> None:
        super().import_row(row, state, token_ids, kv_len)
        self.history.write_known(row, token_ids)
