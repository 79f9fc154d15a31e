"""How decode steps run on the device: the device side of a decode policy (engine/policy.py).

The model runner owns the target: its KV, batch preparation, the target's forward and graphs. A
Decoding owns what a way of decoding adds to that, and the runner calls it without asking which
it is:

  PlainDecoder             one token per decode: nothing beyond the target's forward
  SpecWorker (spec/)       draft/verify/accept decode steps, a draft's KV and per-row state

It also makes its CPU-side counterpart (`policy`), so one place decides what an algorithm needs
on both sides. The plan a policy adds to a batch (ScheduledBatch.spec) becomes the step's inputs
here (`plan_inputs`, StepInputs.spec); engine/ carries both without reading them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import torch

from devices.base import Deferred
from engine.step import StepInputs, StepResult, Target

if TYPE_CHECKING:
    from engine.args import ServerArgs
    from engine.batch import ScheduledBatch
    from engine.launch_budget import LaunchBudget
    from engine.models.attention import AttentionBatch, KVCache
    from engine.models.base import ModelOutput
    from engine.policy import DecodePolicy
    from devices.graphs import GraphRunner

# the step function a Decoding runs a batch's target forward with (ModelRunner.forward_and_sample)
Forward = Callable[[StepInputs], "StepResult | Deferred"]


class Decoding(ABC):
    needs_aux = False                 # the target returns EAGLE-3 aux hidden states for the draft
    plain_decode_graphs = True        # a batch of plain decodes may replay the target's captured decode
    draft_kv: "KVCache | None" = None     # a draft model's own KV (shares the target's slots)
    draft_lookahead = 0               # tokens after a position that the draft's K/V there depends on

    def __init__(self, args: "ServerArgs", target: Target):
        self.args, self.target = args, target

    @abstractmethod
    def describe(self) -> str:
        """For the start-up log line."""

    @abstractmethod
    def policy(self, steps: int, budget: "LaunchBudget") -> "DecodePolicy":
        """The CPU-side decode policy that plans this decoding's batches (up to `steps` a launch)."""

    @abstractmethod
    def kv_bytes_per_slot(self) -> int:
        """KV bytes this decoding adds per slot to the target's."""

    @abstractmethod
    def allocate_kv(self, num_slots: int) -> None:
        """Allocate its own KV once the runner has sized the cache (the target's slots)."""

    @abstractmethod
    def plan_inputs(self, batch: "ScheduledBatch") -> Any:
        """The device-side inputs of the plan the policy added to the batch (StepInputs.spec)."""

    @abstractmethod
    def bookkeeping(self, batch: "ScheduledBatch") -> Callable[[], None]:
        """What must land on the stream before any later step, whatever becomes of this one."""

    @abstractmethod
    def run(self, inp: StepInputs, forward: Forward) -> StepResult | Deferred:
        """On the stream: the batch's step (`forward`: the target's forward and sampling)."""

    @abstractmethod
    def capture_aux(self, inp: StepInputs) -> bool:
        """Does the target's forward of this (non-speculative) batch keep its aux hidden states?"""

    @abstractmethod
    def reads_prompt(self, inp: StepInputs) -> bool:
        """Does the draft read this (non-speculative) batch's forward?"""

    @abstractmethod
    def after_forward(self, inp: StepInputs, input_ids: torch.Tensor, attn: "AttentionBatch",
                      out: "ModelOutput", sampled: torch.Tensor, result: StepResult) -> StepResult | Deferred:
        """After a non-speculative batch's forward and sampling: what its launch returns."""

    @abstractmethod
    def read_run(self, inp: StepInputs, fed: torch.Tensor, outs: list["ModelOutput"], last: torch.Tensor) -> None:
        """After a run of plain decode steps (reads_prompt): the draft reads the run."""

    @abstractmethod
    def idle_step(self, decode: bool, forward: Forward) -> StepResult | Deferred:
        """A step with no rows that makes the model calls of a real one (DP attention)."""

    @abstractmethod
    def export_row(self, row: int) -> dict[str, torch.Tensor]:
        """Per-row device state beyond the KV, on the host, to continue the request elsewhere."""

    @abstractmethod
    def import_row(self, row: int, state: dict[str, Any], token_ids: list[int], kv_len: int) -> None:
        """A request whose KV is in place starts decoding in `row` (its tokens; exported state)."""

    @abstractmethod
    def graph_runners(self) -> list["GraphRunner"]:
        """Its own graph runners (beside the target's)."""

    def planned_graphs(self) -> list[tuple["GraphRunner", dict]]:
        """Its graph runners with the keys serving may replay, for the capture at start-up
        (engine/graph_capture.py)."""
        return []

    def read_draft_kv(self, index: torch.Tensor) -> list[torch.Tensor]:
        """The draft's KV at these slots, per layer [2, n, kv_heads, head_dim] on the host ([]: no draft KV)."""
        return self.draft_kv.read_slots(index) if self.draft_kv else []

    def write_draft_kv(self, index: torch.Tensor, layers: list[torch.Tensor]) -> None:
        """Write what read_draft_kv gave (elsewhere) into these slots."""
        if self.draft_kv:
            self.draft_kv.write_slots(index, layers)


class PlainDecoder(Decoding):
    """One token per decode: the target's forward and sampling is the whole step."""

    def describe(self) -> str:
        return "off"

    def policy(self, steps: int, budget: "LaunchBudget") -> "DecodePolicy":
        from engine.multi_step import MultiStepDecoding
        from engine.policy import PlainDecoding
        return MultiStepDecoding(steps, budget) if steps > 1 else PlainDecoding()

    def kv_bytes_per_slot(self) -> int:
        return 0

    def allocate_kv(self, num_slots: int) -> None:
        pass

    def plan_inputs(self, batch: "ScheduledBatch") -> None:
        return None

    def bookkeeping(self, batch: "ScheduledBatch") -> Callable[[], None]:
        return nothing

    def run(self, inp: StepInputs, forward: Forward) -> StepResult | Deferred:
        return forward(inp)

    def capture_aux(self, inp: StepInputs) -> bool:
        return False

    def reads_prompt(self, inp: StepInputs) -> bool:
        return False

    def after_forward(self, inp, input_ids, attn, out, sampled, result) -> StepResult:
        return result

    def read_run(self, inp, fed, outs, last) -> None:
        pass

    def idle_step(self, decode: bool, forward: Forward) -> StepResult | Deferred:
        return forward(StepInputs.empty(self.target.vocab_size, 1))

    def export_row(self, row: int) -> dict[str, torch.Tensor]:
        return {}

    def import_row(self, row: int, state: dict[str, Any], token_ids: list[int], kv_len: int) -> None:
        pass

    def graph_runners(self) -> list["GraphRunner"]:
        return []


def nothing() -> None:
    """Bookkeeping with nothing to write."""


def create_decoding(args: "ServerArgs", target: Target) -> Decoding:
    """Plain decoding, or the speculative worker of --speculative-algorithm (spec/base.py's registry)."""
    if not args.num_steps:
        return PlainDecoder(args, target)
    from spec.base import create_spec_worker        # lazily: a server without speculation loads no spec worker
    return create_spec_worker(args, target)


def speculation_stats(spec_tokens: int):
    """Speculation's statistics since start (spec/stats.py: SpecStats); without speculation (spec_tokens 0)
    every rank still reports them, as zeros."""
    from spec.stats import SpecStats
    return SpecStats(spec_tokens)
