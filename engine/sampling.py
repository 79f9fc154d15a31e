"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness is the exponential race (argmax of p / E, E ~ Exp(1)), which samples
exactly from p. A seeded request draws its noise from a generator seeded by
(seed, output position), so its output does not depend on batch composition,
retraction or speculation; unseeded requests share the rank's generator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.messages import SamplingParams

SEED_STRIDE = 1_000_003
GENERATOR_SEED_MASK = (1 << 64) - 1     # torch.Generator.manual_seed takes 64-bit seeds


def generator_seed(seed: int, position: int, salt: int) -> int:
    """The generator seed of one row's draw: any request seed (the API allows up to 2**63) gives
    a valid 64-bit seed, the same one every time."""
    return ((seed * SEED_STRIDE + position) * 64 + salt) & GENERATOR_SEED_MASK


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per batch on the CPU."""
    temperature: torch.Tensor      # [N, 1]; 1.0 for greedy rows (unused)
    top_k: torch.Tensor            # [N]; vocab size when off
    top_p: torch.Tensor            # [N]
    min_p: torch.Tensor            # [N]
    greedy: torch.Tensor           # [N] bool
    all_greedy: bool
    needs_sort: bool
    needs_min_p: bool              # some row has min_p > 0 (decided here: no host read on the stream)
    seeds: list[int | None]
    positions: list[int]           # output position of each row, for seeded noise
    max_logprobs: int | None       # None: no row wants logprobs
    grammars: tuple | None = None  # per row, its request's Grammar or None (engine/grammar_masks.py); None: none

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], vocab: int,
              device: torch.device, grammars: list | None = None) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([[1.0 if g else p.temperature] for g, p in zip(greedy, params)],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            needs_sort=any(not g and (k < vocab or p.top_p < 1.0) for g, k, p in zip(greedy, top_k, params)),
            needs_min_p=any(p.min_p > 0 for p in params),
            seeds=[p.seed for p in params],
            positions=positions,
            max_logprobs=max(wanted) if wanted else None,
            grammars=tuple(grammars) if grammars and any(g is not None for g in grammars) else None,
        )


    def advanced(self, steps: int) -> "SamplingBatch":
        """The same rows, each `steps` output positions further (multi-step decoding)."""
        if not steps:
            return self
        return dataclasses.replace(self, positions=[p + steps for p in self.positions])


def filtered_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p."""
    probs = torch.softmax(logits / sb.temperature, dim=-1)
    if sb.needs_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        cumulative = sorted_probs.cumsum(dim=-1)
        drop = (rank[None, :] >= sb.top_k[:, None]) | (cumulative - sorted_probs > sb.top_p[:, None])
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if sb.needs_min_p:
        probs = probs.masked_fill(probs < sb.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def seeded_noise(shape: tuple[int, ...], sb: SamplingBatch, generator: torch.Generator | None,
                 device: torch.device, kind: str = "exponential", salt: int = 0) -> torch.Tensor:
    """Exponential or uniform noise [N, ...]: rows of seeded requests come from a generator
    seeded by (seed, position, salt); the others from the rank's generator."""
    def draw(t: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        return t.exponential_(generator=g) if kind == "exponential" else t.uniform_(generator=g)
    noise = draw(torch.empty(shape, device=device), generator)
    for row, seed in enumerate(sb.seeds):
        if seed is not None:
            g = torch.Generator(device=device).manual_seed(generator_seed(seed, sb.positions[row], salt))
            noise[row] = draw(torch.empty(shape[1:], device=device), g)
    return noise


def exponential_noise(shape: tuple[int, int], sb: SamplingBatch, generator: torch.Generator | None,
                      device: torch.device) -> torch.Tensor:
    return seeded_noise(shape, sb, generator, device)


def sample(logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N]."""
    greedy_ids = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy_ids
    probs = filtered_probs(logits, sb)
    sampled = (probs / exponential_noise(tuple(probs.shape), sb, generator, logits.device)).argmax(dim=-1)
    return torch.where(sb.greedy, greedy_ids, sampled)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's (unfiltered) distribution: chosen tokens [N], and the
    top `top` (values [N, top], ids [N, top])."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    values, ids = logp.topk(max(top, 1), dim=-1)
    return chosen, values, ids
