"""Attention batches of fixed shapes, for captured steps: B sequences of the same q_len each, reading
`width` key positions. The same tensors build_attention_batch gives for such a batch (one part,
every query valid), built without boolean indexing, so that no shape depends on a tensor's values
and nothing is read on the host (a CUDA/NPU graph records the build with the step).
"""
from __future__ import annotations

import torch

from engine.models.attention import AttentionBatch, AttentionPart, Built, KVCache, SeqLayout, pages_of


def fixed_attention_batch(first_pos: torch.Tensor, q_len: int, rows: torch.Tensor, req_to_slot: torch.Tensor,
                          width: int, kv: KVCache) -> AttentionBatch:
    """Sequence b reads its q_len new tokens at positions first_pos[b] .. first_pos[b] + q_len - 1
    (token order: sequence by sequence) over its slot-table row rows[b]; width > every position
    (whole pages for page gathers)."""
    batch, device = rows.shape[0], rows.device
    q_idx = torch.arange(q_len, device=device)
    kv_lens = first_pos + q_len
    tokens = torch.arange(batch * q_len, device=device)
    layout = SeqLayout(q_start=tokens[::q_len], q_lens=torch.full_like(first_pos, q_len), kv_lens=kv_lens, rows=rows,
                       table=req_to_slot, max_q=q_len)

    def build() -> Built:
        pos = first_pos[:, None] + q_idx[None, :]                              # [B, Q]
        k_idx = torch.arange(width, device=device)
        visible = k_idx[None, :] < kv_lens[:, None]                           # [B, K]
        read_slots = req_to_slot[:, :width].index_select(0, rows)
        read_slots = torch.where(visible, read_slots, torch.zeros_like(read_slots))
        causal = k_idx[None, None, :] <= pos[:, :, None]                      # [B, Q, K]
        part = AttentionPart(read_slots=read_slots, query_rows=tokens.view(batch, q_len),
                             mask=(causal & visible[:, None, :]).unsqueeze(1), token_rows=tokens,
                             read_pages=pages_of(read_slots, kv.page_size))
        write_slots = req_to_slot[rows[:, None], pos].reshape(-1)
        return pos.reshape(-1), write_slots, [part]
    return AttentionBatch(kv, layout, build)
