"""Paged attention over a slot-indexed KV cache, for any mix of prefill chunks,
decodes and verify runs in one flattened batch.

Layout of one forward (B sequences, T tokens in all):

  input tokens   [T]         sequence b owns tokens q_start[b] .. q_start[b]+q_len[b]
  positions      [T]         absolute position of each token in its sequence
  write_slots    [T]         KV slot each token's K/V is written to
  read_slots     [B, K]      slot of key position j of sequence b (j < kv_len[b]; padding reads slot 0)
  query_rows     [B, Q]      which of the T tokens is query i of sequence b (padding repeats a real row)
  mask           [B, 1, Q, K] key j is visible to query i  <=>  j <= pos(i) and j < kv_len[b]
  token_rows     [T]         where token t's output sits in the flattened [B*Q] result

Every tensor here is built with torch ops from four inputs (q_lens, kv_lens, the
request rows and the request->slot table), so the same builder runs on CPU data
or on device-resident lengths that the CPU has not seen (speculation with overlap).
Only the padded sizes Q and K must be known on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """Per-layer K and V tensors of shape [num_slots, num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> "KVCache":
        shape = (num_slots, num_kv_heads, head_dim)
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class AttentionBatch:
    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    query_rows: torch.Tensor
    mask: torch.Tensor
    token_rows: torch.Tensor
    kv: KVCache

    @property
    def is_single_query(self) -> bool:
        return self.query_rows.shape[1] == 1


def build_attention_batch(q_lens: torch.Tensor, kv_lens: torch.Tensor, req_rows: torch.Tensor,
                          req_to_slot: torch.Tensor, max_q: int, max_k: int,
                          kv: KVCache) -> AttentionBatch:
    """q_lens, kv_lens, req_rows: [B] long tensors on the cache's device; kv_lens count
    the new tokens too. req_to_slot: [rows, context] slot table. max_q >= q_lens.max(),
    max_k >= kv_lens.max()."""
    device = q_lens.device
    batch = q_lens.shape[0]
    q_start = torch.cumsum(q_lens, 0) - q_lens                       # [B]
    q_idx = torch.arange(max_q, device=device)                       # [Q]
    valid_q = q_idx[None, :] < q_lens[:, None]                       # [B, Q]
    first_pos = kv_lens - q_lens                                     # [B]
    query_pos = torch.where(valid_q, first_pos[:, None] + q_idx[None, :], torch.zeros_like(valid_q, dtype=torch.long))
    last_row = (q_start + q_lens - 1).clamp(min=0)
    query_rows = torch.where(valid_q, q_start[:, None] + q_idx[None, :], last_row[:, None])
    flat_valid = valid_q.reshape(-1)
    token_rows = torch.arange(batch * max_q, device=device)[flat_valid]
    positions = query_pos.reshape(-1)[flat_valid]
    seq_of_token = torch.arange(batch, device=device).repeat_interleave(max_q)[flat_valid]
    write_slots = req_to_slot[req_rows[seq_of_token], positions]
    k_idx = torch.arange(max_k, device=device)
    read_slots = req_to_slot[:, :max_k].index_select(0, req_rows)
    visible_k = k_idx[None, :] < kv_lens[:, None]                    # [B, K]
    read_slots = torch.where(visible_k, read_slots, torch.zeros_like(read_slots))
    causal = k_idx[None, None, :] <= query_pos[:, :, None]           # [B, Q, K]
    mask = (causal & visible_k[:, None, :]).unsqueeze(1)
    return AttentionBatch(positions=positions, write_slots=write_slots, read_slots=read_slots,
                          query_rows=query_rows, mask=mask, token_rows=token_rows, kv=kv)


def chain_step_batch(positions: torch.Tensor, table_slots: torch.Tensor, kv: KVCache) -> AttentionBatch:
    """One new token per sequence at `positions` [B], for the steps of a draft chain: `table_slots`
    [B, K] is the sequences' slot table (K > every position), sliced once and shared by the chain's
    steps; keys after each position are masked, so nothing past it is read."""
    batch, width = table_slots.shape
    device = positions.device
    k_idx = torch.arange(width, device=device)
    rows = torch.arange(batch, device=device)
    return AttentionBatch(positions=positions, write_slots=table_slots[rows, positions], read_slots=table_slots,
                          query_rows=rows[:, None], mask=(k_idx[None, :] <= positions[:, None])[:, None, None, :],
                          token_rows=rows, kv=kv)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Writes k, v to the cache,
    attends over each sequence's keys, returns [T, H, D].

    Gathers use index_select / index_copy_ on flattened indices: on the CPU they copy whole
    rows, several times faster than advanced indexing (the gathers dominate large batches)."""
    k_cache, v_cache = batch.kv.k[layer_id], batch.kv.v[layer_id]
    k_cache.index_copy_(0, batch.write_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.write_slots, v.to(v_cache.dtype))
    seqs, width = batch.read_slots.shape
    slots = batch.read_slots.reshape(-1)
    keys = k_cache.index_select(0, slots).view(seqs, width, *k_cache.shape[1:]).transpose(1, 2)   # [B, Hkv, K, D]
    values = v_cache.index_select(0, slots).view(seqs, width, *v_cache.shape[1:]).transpose(1, 2)
    queries = q.index_select(0, batch.query_rows.reshape(-1)).view(seqs, -1, *q.shape[1:]).transpose(1, 2)  # [B, H, Q, D]
    if keys.dtype != queries.dtype:
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=scale,
                                         enable_gqa=keys.shape[1] != queries.shape[1])
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])     # [B*Q, H, D]
    return out.index_select(0, batch.token_rows)
