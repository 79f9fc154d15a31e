"""The typed contract between the model runner, its decoding (engine/decoding.py) and the engine
core: what a launched step reads (StepInputs, host tensors built on the CPU) and what it produces
(StepResult, host tensors read once its launch resolved), and the narrow handle on the target
model that a decoding gets (Target) instead of the whole runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.batch import StepOutput
from engine.graph_shape import GraphShape, key_width
from engine.sampling import SamplingBatch, token_logprobs

if TYPE_CHECKING:
    from devices.base import Device
    from engine.models.attention import KVCache, Group
    from engine.future_map import FutureMap
    from engine.models.base import CausalLM
    from engine.target_graphs import TargetGraphs


@dataclass
class StepInputs:
    """Host tensors of one batch; kept referenced until its work has run."""
    input_ids: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    rows: torch.Tensor
    sample_rows: torch.Tensor      # index of each sampling sequence's last token among the T tokens
    future_ids: torch.Tensor
    max_q: int
    max_kv: int
    sampling: SamplingBatch
    spec: Any = None                      # what the decoding adds (Decoding.plan_inputs; spec/inputs.py)
    groups: list[Group] | None = None     # attention parts (host indices): decodes apart from prompt chunks
    graph: GraphShape | None = None       # the captured graph its target forward replays (None: eager)
    steps: int = 1                        # decode steps back to back (ScheduledBatch.steps)

    @classmethod
    def empty(cls, vocab_size: int, width: int, spec: Any = None) -> "StepInputs":
        """A batch with no rows whose steps are `width` tokens a row (an idle step: DP attention)."""
        empty = torch.zeros(0, dtype=torch.long)
        return cls(input_ids=empty, q_lens=empty, kv_lens=empty, rows=empty, sample_rows=empty, future_ids=empty,
                   max_q=width, max_kv=width, sampling=SamplingBatch.build([], [], vocab_size, torch.device("cpu")),
                   spec=spec)


@dataclass
class StepResult:
    """What a launched step produced, as host tensors (read them once its launch resolved)."""
    emitted: torch.Tensor | None = None        # [B, R] tokens; row b's first accepted[b] + 1 count
    accepted: torch.Tensor | None = None       # [B] accepted drafts (0: one token)
    logprobs: torch.Tensor | None = None       # [B, R] of the emitted tokens, when a row asked
    top_values: torch.Tensor | None = None     # [B, R, top]
    top_ids: torch.Tensor | None = None
    marks: list = field(default_factory=list)  # speculative steps: (phase, device mark), "start" first
    drafted: torch.Tensor | None = None        # speculative steps: [B] drafts each row verified
    verify_tokens: int = 0                     # speculative steps: tokens the verify forward read
    rounds: list["StepResult"] | None = None   # a multi-round speculative launch: each round's result
    seqs: int = 0                              # a multi-round launch: its sampling sequences

    @classmethod
    def of_rounds(cls, rounds: list["StepResult"], seqs: int) -> "StepResult":
        """One result for the rounds of a launch of `seqs` sequences; its marks run through every
        round's phases. No rounds (every row had ended): each sequence emits nothing."""
        marks = rounds[0].marks + [mark for r in rounds[1:] for mark in r.marks[1:]] if rounds else []
        return cls(marks=marks, rounds=rounds, verify_tokens=sum(r.verify_tokens for r in rounds), seqs=seqs)

    def output(self) -> StepOutput:
        """Host lists (call once the step's launch resolved)."""
        if self.rounds == []:
            return StepOutput(tokens=[[] for _ in range(self.seqs)], rounds=[[] for _ in range(self.seqs)])
        if self.rounds:
            return StepOutput.joined([r.output() for r in self.rounds])
        if self.emitted is None:
            return StepOutput(tokens=[])
        counts = [n + 1 for n in self.accepted.tolist()]
        out = StepOutput(tokens=[row[:c] for row, c in zip(self.emitted.tolist(), counts)])
        if self.logprobs is not None:
            out.logprobs = [row[:c] for row, c in zip(self.logprobs.tolist(), counts)]
            out.top_logprobs = [[list(zip(i, v)) for i, v in zip(ids[:c], vals[:c])] for ids, vals, c in
                                zip(self.top_ids.tolist(), self.top_values.tolist(), counts)]
        return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that does not wait for the device (read it once the step's launch resolved)."""
    return tensor.to("cpu", non_blocking=True)


def step_result(emitted: torch.Tensor, n: torch.Tensor, logits: torch.Tensor | None, sb: SamplingBatch,
                **extra: Any) -> StepResult:
    """Host copies of a step's outputs (on the stream): emitted [B, R] tokens of which the first
    n+1 count, and, when asked, logprobs of the model's distribution at each of the R rows."""
    host = to_host
    result = StepResult(emitted=host(emitted), accepted=host(n), **extra)
    if sb.max_logprobs is not None:
        batch, rows = emitted.shape
        chosen, values, ids = token_logprobs(logits.reshape(batch * rows, -1), emitted.reshape(-1), sb.max_logprobs)
        result.logprobs = host(chosen.view(batch, rows))
        result.top_values, result.top_ids = host(values.view(batch, rows, -1)), host(ids.view(batch, rows, -1))
    return result


@dataclass
class RequestState:
    """A request at a step boundary (nothing in flight for it), enough to continue it under another
    engine built from the same weights. Host tensors and plain data.

    Positions [0, kv_len) are in the KV cache; the request's last output token (at position kv_len)
    is not: the next step feeds it."""
    kv_len: int
    target_kv: list[torch.Tensor]               # per layer [2, kv_len, kv_heads, head_dim]: K and V
    draft_kv: list[torch.Tensor]                # the draft model's or head's own, same layout ([] without)
    draft_row: dict[str, torch.Tensor]          # per-row draft state (EAGLE: its hidden state and first draft)
    record: dict                                # the decode policy's record of the request (CPU side)


@dataclass
class Target:
    """What a decoding (a speculative worker) may use of the target side. `kv` and `req_to_slot` are set once
    the cache is sized (a draft's own KV counts in that size).

    The slot table has one row more than there are request rows: row `pad_row` is the padding row of
    captured steps, every position of which maps to the padding page (past the pages the KV pool
    hands out; engine/model_runner.py allocate_kv). No request owns either."""
    model: CausalLM
    device: Device
    dtype: torch.dtype
    vocab_size: int
    num_rows: int
    table_width: int
    page_size: int
    generator: torch.Generator
    kv: KVCache | None = None
    req_to_slot: torch.Tensor | None = None
    graphs: TargetGraphs | None = None        # the target's captured steps (None: graphs off)
    futures: FutureMap | None = None          # where a step stores each sampling row's last token
    dp_attention: bool = False                # DP attention: every rank makes the same model calls a step

    @property
    def torch_device(self) -> torch.device:
        return self.device.torch_device

    @property
    def pad_row(self) -> int:
        return self.num_rows

    def key_width(self, max_kv: int) -> int:
        """The key positions a captured step reads for sequences of at most max_kv positions."""
        return key_width(max_kv, self.page_size, self.table_width)
