"""Paged attention over a slot-indexed KV cache, for any mix of prefill chunks,
decodes and verify runs in one flattened batch.

Layout of one forward (B sequences, T tokens in all):

  input tokens   [T]         sequence b owns tokens q_start[b] .. q_start[b]+q_len[b]
  positions      [T]         absolute position of each token in its sequence
  write_slots    [T]         KV slot each token's K/V is written to

and, per part (a group of the sequences, padded to its own widths Q and K; one part unless
the CPU split the batch, see attention_groups):

  read_slots     [B, K]      slot of key position j of sequence b (j < kv_len[b]; padding reads slot 0)
  query_rows     [B, Q]      which of the T tokens is query i of sequence b (padding repeats a real row)
  mask           [B, 1, Q, K] key j is visible to query i  <=>  j <= pos(i) and j < kv_len[b]
  token_rows     [n]         where the part's real queries sit in its flattened [B*Q] result
  out_rows       [n]         which of the T tokens those are (None: all T, in order)

Padding every sequence to the batch's widest would make a decode next to a 200-token prompt
chunk attend like 200 queries (bench/mixed_batch.py measures both ways).

Every tensor here is built with torch ops from four inputs (q_lens, kv_lens, the
request rows and the request->slot table), so the same builder runs on CPU data
or on device-resident lengths that the CPU has not seen (speculation with overlap).
Only the padded sizes Q and K must be known on the CPU.

The native CPU kernels (devices/native/attention.cpp) read those four inputs directly (`SeqLayout`)
and walk each sequence's slots in place; the tensors above are built on first use, so a forward
on the native path never builds them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from devices.cpu import lazily_committed_zeros


@dataclass
class KVCache:
    """Per-layer K and V tensors of shape [num_slots, num_kv_heads, head_dim]. With page_size > 1,
    slot s is entry s % page_size of page s // page_size, and a page holds page_size consecutive
    positions of one request (KVPool's layout), so attention gathers whole pages."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int = 1

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", page_size: int = 1) -> "KVCache":
        shape = (num_slots, num_kv_heads, head_dim)

        def zeros() -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return lazily_committed_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(k=[zeros() for _ in range(num_layers)], v=[zeros() for _ in range(num_layers)],
                   page_size=page_size)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def read_slots(self, index: torch.Tensor) -> list[torch.Tensor]:
        """K and V of these slots, per layer [2, n, kv_heads, head_dim], on the host."""
        return [torch.stack([k.index_select(0, index), v.index_select(0, index)]).to("cpu")
                for k, v in zip(self.k, self.v)]

    def write_slots(self, index: torch.Tensor, layers: list[torch.Tensor]) -> None:
        """Write what read_slots gave into these slots."""
        for k, v, pair in zip(self.k, self.v, layers):
            pair = pair.to(k.device)
            k.index_copy_(0, index, pair[0])
            v.index_copy_(0, index, pair[1])


@dataclass
class AttentionPart:
    """The attention of some of a batch's sequences (see the module docstring)."""
    read_slots: torch.Tensor
    query_rows: torch.Tensor
    mask: torch.Tensor
    token_rows: torch.Tensor
    out_rows: torch.Tensor | None = None
    read_pages: torch.Tensor | None = None     # [B, K / page_size]: the pages read_slots lie in, when paged


def padded_width(max_k: int, page_size: int) -> int:
    """Key positions a part reads: max_k rounded up to whole pages (the slot table is that wide)."""
    return -(-max_k // page_size) * page_size


def pages_of(read_slots: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """[B, K] slots of whole pages -> [B, K / page_size] page numbers (None: gather slot by slot).
    Invisible positions read slot 0, so a page past a sequence's end reads page 0 (masked)."""
    if page_size == 1 or read_slots.shape[1] % page_size:
        return None
    return torch.div(read_slots[:, ::page_size], page_size, rounding_mode="floor")


@dataclass
class SeqLayout:
    """A batch per sequence: sequence b owns tokens q_start[b] .. q_start[b] + q_lens[b], has kv_lens[b]
    positions (its new tokens included) and table[rows[b], p] is the slot of its position p. All [B]
    long tensors but `table` [rows, width]."""
    q_start: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    rows: torch.Tensor
    table: torch.Tensor
    max_q: int                  # host-known bound on q_lens

    def __post_init__(self):
        for name in ("q_start", "q_lens", "kv_lens", "rows"):
            setattr(self, name, getattr(self, name).contiguous())


# What the pure-torch path reads: (positions [T], write_slots [T], parts).
Built = tuple[torch.Tensor, torch.Tensor, list[AttentionPart]]


class AttentionBatch:
    """One forward's attention inputs: the layout, and the pure-torch path's tensors built from it
    on first use (see the module docstring)."""

    def __init__(self, kv: KVCache, layout: SeqLayout, build: Callable[[], Built]):
        self.kv, self.layout, self.build = kv, layout, build

    def with_kv(self, kv: KVCache) -> "AttentionBatch":
        """The same batch over another cache (the draft's, a snapshot); what is built is shared."""
        other = AttentionBatch(kv, self.layout, self.build)
        if "built" in self.__dict__:
            other.built = self.built
        return other

    @functools.cached_property
    def built(self) -> Built:
        return self.build()

    @property
    def positions(self) -> torch.Tensor:
        return self.built[0]

    @property
    def write_slots(self) -> torch.Tensor:
        return self.built[1]

    @property
    def parts(self) -> list[AttentionPart]:
        return self.built[2]


class Group(NamedTuple):
    """Some of a batch's sequences, padded apart: their indices [G] on the cache's device, the widest
    q_len and kv_len among them, and their token count (host-known, so nothing waits for the device)."""
    seqs: torch.Tensor
    max_q: int
    max_k: int
    tokens: int


def attention_groups(q_lens: list[int], kv_lens: list[int], device: torch.device | str) -> list[Group] | None:
    """Host-known lengths: split single-token sequences (decodes) from prompt chunks when a batch
    has both, so each group is padded to its own widths. None: one group (nothing to gain)."""
    single = [i for i, q in enumerate(q_lens) if q == 1]
    if not single or len(single) == len(q_lens):
        return None
    chunks = [i for i, q in enumerate(q_lens) if q > 1]
    return [Group(torch.tensor(single, dtype=torch.long, device=device), 1, max(kv_lens[i] for i in single),
                  len(single)),
            Group(torch.tensor(chunks, dtype=torch.long, device=device), max(q_lens[i] for i in chunks),
                  max(kv_lens[i] for i in chunks), sum(q_lens[i] for i in chunks))]


def build_attention_batch(q_lens: torch.Tensor, kv_lens: torch.Tensor, req_rows: torch.Tensor,
                          req_to_slot: torch.Tensor, max_q: int, max_k: int,
                          kv: KVCache, groups: list[Group] | None = None, *, tokens: int) -> AttentionBatch:
    """q_lens, kv_lens, req_rows: [B] long tensors on the cache's device; kv_lens count
    the new tokens too. req_to_slot: [rows, context] slot table. max_q >= q_lens.max(),
    max_k >= kv_lens.max(), tokens == q_lens.sum() (host-known: the real tokens are then found
    by arithmetic, never by a boolean mask whose size an accelerator would have to report).
    groups (from attention_groups): parts padded apart."""
    q_start = torch.cumsum(q_lens, 0) - q_lens                       # [B]
    layout = SeqLayout(q_start=q_start, q_lens=q_lens, kv_lens=kv_lens, rows=req_rows, table=req_to_slot,
                       max_q=max_q)

    def build() -> Built:
        first_pos = kv_lens - q_lens                                 # [B]
        seq, offset = token_seqs(q_lens, max_q, tokens)
        positions = first_pos[seq] + offset if offset is not None else first_pos
        write_slots = req_to_slot[req_rows[seq], positions]
        page = kv.page_size
        if groups is None:
            parts = [attention_part(QueryGrid.of(q_lens, first_pos, max_q, (seq, offset)), q_start, q_lens, kv_lens,
                                    req_rows, req_to_slot, padded_width(max_k, page), page, subset=False)]
        else:
            parts = [attention_part(QueryGrid.of(q_lens[g.seqs], first_pos[g.seqs], g.max_q,
                                                 token_seqs(q_lens[g.seqs], g.max_q, g.tokens)),
                                    q_start[g.seqs], q_lens[g.seqs], kv_lens[g.seqs], req_rows[g.seqs], req_to_slot,
                                    padded_width(g.max_k, page), page, subset=True)
                     for g in groups]
        return positions, write_slots, parts
    return AttentionBatch(kv, layout, build)


def token_seqs(q_lens: torch.Tensor, max_q: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each of the `tokens` real tokens' sequence and its offset in it, in token order, by arithmetic
    (a boolean mask of the padded grid would make an accelerator report its size). One token in
    every sequence (decodes): token b is sequence b, offset None (0)."""
    device = q_lens.device
    if max_q == 1 and tokens == q_lens.shape[0]:
        return torch.arange(tokens, device=device), None
    # output_size: repeat_interleave would otherwise read the total from the device
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=device), q_lens, output_size=tokens)
    return seq, torch.arange(tokens, device=device) - (torch.cumsum(q_lens, 0) - q_lens)[seq]


@dataclass
class QueryGrid:
    """Sequences [G] padded to Q queries: q_idx [Q], valid [G, Q] (a real token), pos [G, Q] (its
    position; 0 for padding); flat [T]: each real token's place in the flattened [G*Q] grid, in
    token order."""
    q_idx: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    flat: torch.Tensor

    @classmethod
    def of(cls, q_lens: torch.Tensor, first_pos: torch.Tensor, max_q: int,
           seqs: tuple[torch.Tensor, torch.Tensor | None]) -> "QueryGrid":
        """seqs: token_seqs of these sequences."""
        q_idx = torch.arange(max_q, device=q_lens.device)
        valid = q_idx[None, :] < q_lens[:, None]
        pos = torch.where(valid, first_pos[:, None] + q_idx[None, :], torch.zeros_like(valid, dtype=torch.long))
        seq, offset = seqs
        return cls(q_idx=q_idx, valid=valid, pos=pos, flat=seq * max_q + offset if offset is not None else seq)


def attention_part(grid: QueryGrid, q_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                   req_rows: torch.Tensor, req_to_slot: torch.Tensor, max_k: int, page_size: int,
                   subset: bool) -> AttentionPart:
    """The part of sequences [G] (their token offsets q_start into the batch); subset: not all of it."""
    device = q_lens.device
    last_row = (q_start + q_lens - 1).clamp(min=0)
    query_rows = torch.where(grid.valid, q_start[:, None] + grid.q_idx[None, :], last_row[:, None])
    k_idx = torch.arange(max_k, device=device)
    read_slots = req_to_slot[:, :max_k].index_select(0, req_rows)
    visible_k = k_idx[None, :] < kv_lens[:, None]                    # [G, K]
    read_slots = torch.where(visible_k, read_slots, torch.zeros_like(read_slots))
    causal = k_idx[None, None, :] <= grid.pos[:, :, None]            # [G, Q, K]
    mask = (causal & visible_k[:, None, :]).unsqueeze(1)
    return AttentionPart(read_slots=read_slots, query_rows=query_rows, mask=mask, token_rows=grid.flat,
                         out_rows=query_rows.reshape(-1)[grid.flat] if subset else None,
                         read_pages=pages_of(read_slots, page_size))


def chain_step_batch(positions: torch.Tensor, table_slots: torch.Tensor, kv: KVCache) -> AttentionBatch:
    """One new token per sequence at `positions` [B], for the steps of a draft chain: `table_slots`
    [B, K] is the sequences' slot table (K > every position; padded_width for page gathers), sliced
    once and shared by the chain's steps; keys after each position are masked, so nothing past it
    is read (table entries there may be unset: slot 0, page 0)."""
    batch, width = table_slots.shape
    rows = torch.arange(batch, device=positions.device)
    ones = torch.ones_like(positions)
    layout = SeqLayout(q_start=rows, q_lens=ones, kv_lens=positions + 1, rows=rows, table=table_slots, max_q=1)

    def build() -> Built:
        k_idx = torch.arange(width, device=positions.device)
        part = AttentionPart(read_slots=table_slots, query_rows=rows[:, None],
                             mask=(k_idx[None, :] <= positions[:, None])[:, None, None, :], token_rows=rows,
                             read_pages=pages_of(table_slots, kv.page_size))
        return positions, table_slots[rows, positions], [part]
    return AttentionBatch(kv, layout, build)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Writes k, v to the cache,
    attends over each sequence's keys, returns [T, H, D].

    Gathers use index_select / index_copy_ on flattened indices: on the CPU they copy whole
    rows, several times faster than advanced indexing (the gathers dominate large batches). With
    pages, whole pages are copied: a slot-by-slot gather of requests that grew side by side reads
    rows a batch apart, much slower than the same keys page by page (docs/performance-history.md)."""
    k_cache, v_cache = batch.kv.k[layer_id], batch.kv.v[layer_id]
    k_cache.index_copy_(0, batch.write_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.write_slots, v.to(v_cache.dtype))
    page = batch.kv.page_size
    if len(batch.parts) == 1 and batch.parts[0].out_rows is None:
        return attend(q, k_cache, v_cache, batch.parts[0], scale, page)
    out = q.new_empty(q.shape)
    for part in batch.parts:
        out.index_copy_(0, part.out_rows, attend(q, k_cache, v_cache, part, scale, page))
    return out


def gather(cache: torch.Tensor, part: AttentionPart, page_size: int) -> torch.Tensor:
    """The part's keys (or values) in position order: [B, K, Hkv, D]."""
    seqs, width = part.read_slots.shape
    if part.read_pages is None:
        return cache.index_select(0, part.read_slots.reshape(-1)).view(seqs, width, *cache.shape[1:])
    whole = cache.shape[0] // page_size * page_size
    pages = cache[:whole].view(-1, page_size, *cache.shape[1:])
    return pages.index_select(0, part.read_pages.reshape(-1)).view(seqs, width, *cache.shape[1:])


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: AttentionPart,
           scale: float, page_size: int) -> torch.Tensor:
    """One part's queries over its sequences' cached keys: [n, H, D], in token_rows order."""
    seqs, width = part.query_rows.shape
    keys = gather(k_cache, part, page_size).transpose(1, 2)          # [B, Hkv, K, D]
    values = gather(v_cache, part, page_size).transpose(1, 2)
    queries = q.index_select(0, part.query_rows.reshape(-1)).view(seqs, width, *q.shape[1:])
    queries = queries.transpose(1, 2)                                 # [B, H, Q, D]
    if keys.dtype != queries.dtype:
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=part.mask, scale=scale,
                                         enable_gqa=keys.shape[1] != queries.shape[1])
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])     # [B*Q, H, D]
    return out.index_select(0, part.token_rows)
