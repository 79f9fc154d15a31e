"""What a speculative step (or a prefill with speculation on) reads on the device beyond the
target's inputs (StepInputs.spec), made from the batch's plan (spec/plan.py) on the CPU."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.batch import ScheduledBatch
from engine.step import StepInputs
from spec.plan import SpecPlan


@dataclass
class SpecInputs:
    """What a speculative step (or a prefill with speculation on) adds to its inputs."""
    decode: bool                  # a draft/verify step (else a prefill batch)
    chain: int                    # decode: draft tokens per request (0: a plain step under load)
    draft_lag: torch.Tensor       # decode: tokens each request's draft model has not read yet
    draft_next: torch.Tensor      # prefill: the token after each chunk (-1: the sampled one)
    draft_skip: bool = False      # prefill: the draft model does not read this batch
    no_decode: bool = False       # prefill: no request of it decodes here; the draft need not read it
    plain_decodes: bool = False   # prefill: plain decodes alone; the draft reads them before the launch
                                  # resolves, so the launch's device time (the gate's plain cost) counts it
    trim: bool = True             # decode: rows may verify fewer drafts where the device reads for free
    length_cap: torch.Tensor | None = None    # decode: each row's length at its request's end (max tokens, context)
    yield_at: int | None = None   # decode: no round starts once prompts arrived past this count (spec/arrivals.py)
    cached_tokens: tuple = ()     # prefill: (row, tokens) of cached prefixes (SpecPlan.cached_tokens)

    @classmethod
    def of_batch(cls, batch: ScheduledBatch) -> "SpecInputs":
        """The inputs of a batch that speculative decoding planned (batch.spec: a SpecPlan)."""
        plan: SpecPlan = batch.spec
        return cls(decode=plan.decode, chain=plan.chain, draft_lag=long_tensor(plan.draft_lag),
                   draft_next=long_tensor(plan.draft_next), draft_skip=plan.draft_skip, no_decode=plan.no_decode,
                   length_cap=long_tensor(plan.length_cap) if plan.decode else None, yield_at=plan.yield_at,
                   cached_tokens=tuple(plan.cached_tokens),
                   plain_decodes=not plan.decode and all(seq.decode for seq in batch.seqs))

    @classmethod
    def idle(cls, decode: bool, chain: int) -> "SpecInputs":
        """Of a step with no rows (DP attention): a whole chain of `chain` drafts, or a prefill."""
        empty = long_tensor([])
        return cls(decode=decode, chain=chain, draft_lag=empty, draft_next=empty, trim=False)


def round_inputs(inp: StepInputs, i: int) -> StepInputs:
    """Round i of a multi-round speculative launch: the noise keys i steps further; the draft
    read everything the round before accepted (no lag). The rows' positions live on the device."""
    if i == 0:
        return inp
    spec = dataclasses.replace(inp.spec, draft_lag=torch.zeros_like(inp.spec.draft_lag))
    return dataclasses.replace(inp, sampling=inp.sampling.advanced(i), spec=spec)


def long_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
