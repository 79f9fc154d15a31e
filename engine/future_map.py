"""The future map: a device-resident ring where batch N stores what it sampled, so
batch N+1 (scheduled before N finished) can name those tokens by reference.

A fed input id -f (f > 0) means "the token in slot f". The scheduler hands out slots
in a ring of `size`; a slot is rewritten only after `size - 1` newer samples, which
must exceed the rows of the batches in flight (two with overlap).
"""
from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, size: int, device: torch.device):
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace references (negative ids) by the tokens they name. Runs on the stream."""
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp(min=0)], input_ids)

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens[slots] = tokens
