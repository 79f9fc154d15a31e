"""Speculative decoding plugs into the rank's ModelRunner: a worker owns the draft
side (a draft model and its KV cache, or none) and the per-row speculative state on
the device; the scheduler only knows that a decode step feeds k+1 tokens.

Per-row device state, written by the step that produced it and read by the next
(the device runs steps in order, so the CPU never waits for it):

  kv_len[row]        tokens of the request in the KV cache (target and draft share slots)
  bonus[row]         the last emitted token, not yet in the cache (fed first by the next verify)
"""
from __future__ import annotations

import importlib
from collections import deque
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from engine.models.attention import KVCache

if TYPE_CHECKING:
    from engine.model_runner import BatchInputs, ModelRunner
    from engine.models.attention import AttentionBatch
    from engine.models.base import ModelOutput

ALGORITHMS = {
    "eagle": "spec.eagle_worker:EagleWorker",
    "eagle3": "spec.eagle_worker:EagleWorker",
    "standalone": "spec.standalone_worker:StandaloneWorker",
    "ngram": "spec.ngram_worker:NgramWorker",
}


def normalize_algorithm(name: str | None) -> str:
    name = (name or "none").lower()
    return "none" if name in ("none", "") else name


class SpecWorker(ABC):
    needs_aux = False          # the target must return EAGLE-3 aux hidden states

    def __init__(self, runner: "ModelRunner", num_steps: int):
        self.runner = runner
        self.k = num_steps
        rows, dev = runner.num_rows, runner.device.torch_device
        self.kv_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.bonus = torch.zeros(rows, dtype=torch.long, device=dev)
        self.phase_marks: deque[list[tuple[str, object]]] = deque()   # per decode step, in launch order

    def mark(self, phase: str, marks: list) -> None:
        """Record the end of a phase (draft, verify, extend) of the step being launched."""
        marks.append((phase, self.runner.device.mark()))

    def take_phase_times(self) -> list[tuple[str, float]]:
        """(phase, seconds) of the oldest finished decode step; call once per finished step."""
        marks = self.phase_marks.popleft()
        device = self.runner.device
        return [(name, device.seconds_between(prev, cur)) for (_, prev), (name, cur) in zip(marks, marks[1:])]

    @abstractmethod
    def after_prefill(self, inp: "BatchInputs", input_ids: torch.Tensor, attn: "AttentionBatch",
                      out: "ModelOutput", sampled: torch.Tensor) -> None:
        """On the stream, after a prefill batch sampled: seed the rows whose prompt is now complete."""

    @abstractmethod
    def decode_step(self, inp: "BatchInputs") -> tuple:
        """On the stream: draft, verify, accept, update state. Returns host tensors
        (emitted [B, k+1], accepted drafts n [B], and logprob tensors when asked)."""

    def draft_kv_layout(self) -> tuple[int, int, int] | None:
        """(layers, kv_heads, head_dim) of the draft's own KV cache; None without a draft model."""
        return None

    def kv_bytes_per_slot(self) -> int:
        """Bytes of the draft's own KV per slot (0 without a draft model)."""
        layout = self.draft_kv_layout()
        return KVCache.bytes_per_slot(*layout, self.runner.dtype) if layout else 0

    def allocate_kv(self, num_slots: int) -> None:
        """Called once the runner has sized the cache: the draft's KV shares the target's slots."""
        layout = self.draft_kv_layout()
        if layout:
            layers, kv_heads, head_dim = layout
            self.draft_kv = KVCache.allocate(layers, num_slots, kv_heads, head_dim, self.runner.dtype,
                                             self.runner.device.torch_device)


def create_spec_worker(algorithm: str, runner: "ModelRunner") -> SpecWorker:
    module, cls = ALGORITHMS[algorithm].split(":")
    return getattr(importlib.import_module(module), cls)(runner)
