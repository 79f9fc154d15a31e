"""A minimal driver that runs a model over the paged KV cache the way the engine does, for
tests and checkpoint checks (tools/, bench/): several requests, each with its own row of a
req_to_slot table, any mix of prefill chunks and decodes in one flattened batch.

Slots come from a shuffled permutation (of whole pages with page_size > 1, KVPool's layout), so
code that silently assumes contiguous slots fails.

    runner = PagedRunner(model.kv_layout(), torch.float32)
    ids, batch = runner.step([(0, [5, 6, 7]), (1, [9])])     # request 0 prefills 3, request 1 adds 1
    out = model(ids, batch)                                   # rows in the same order as the chunks
"""
from __future__ import annotations

import torch

from engine.models.attention import AttentionBatch, KVCache, attention_groups, build_attention_batch


class PagedRunner:
    def __init__(self, kv_layout: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str = "cpu",
                 max_requests: int = 8, max_context: int = 128, seed: int = 0, page_size: int = 1):
        num_layers, num_kv_heads, head_dim = kv_layout
        if max_context % page_size:
            raise ValueError(f"max_context {max_context} is not a whole number of {page_size}-token pages")
        num_pages = max_requests * max_context // page_size + 1
        generator = torch.Generator().manual_seed(seed)
        pages = torch.randperm(num_pages, generator=generator)[:num_pages - 1]
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        self.req_to_slot = slots.view(max_requests, max_context).to(device)
        self.kv = KVCache.allocate(num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype, device,
                                   page_size)
        self.lengths = [0] * max_requests       # tokens of each request already in the cache
        self.device = device

    def step(self, chunks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, AttentionBatch]:
        """chunks: (request row, new token ids) per sequence of the batch. Returns the flattened
        input ids [T] and the AttentionBatch; the K/V of the new tokens land in the cache when
        the model runs."""
        rows = [row for row, _ in chunks]
        if len(set(rows)) != len(rows):
            raise ValueError("a request appears twice in one step")
        q_lens = [len(tokens) for _, tokens in chunks]
        for row, q_len in zip(rows, q_lens):
            self.lengths[row] += q_len
        kv_lens = [self.lengths[row] for row in rows]
        def as_long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        batch = build_attention_batch(as_long(q_lens), as_long(kv_lens), as_long(rows), self.req_to_slot,
                                      max_q=max(q_lens), max_k=max(kv_lens), kv=self.kv,
                                      groups=attention_groups(q_lens, kv_lens, self.device), tokens=sum(q_lens))
        input_ids = as_long([token for _, tokens in chunks for token in tokens])
        return input_ids, batch

    def reset(self, row: int) -> None:
        """Forget a request's tokens (its slots are reused by the next request on that row)."""
        self.lengths[row] = 0


@torch.inference_mode()
def step_logits(model, runner: PagedRunner, steps: list[list[tuple[int, list[int]]]]) -> torch.Tensor:
    """Every token's logits [T, V] over `steps` (each a runner.step's chunks), in order."""
    outs = []
    for chunks in steps:
        ids, batch = runner.step(chunks)
        outs.append(model.compute_logits(model(ids, batch).hidden))
    return torch.cat(outs)
