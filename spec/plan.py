"""What speculative decoding adds to a batch (spec/policy.py fills it; pure Python: no tensors).
engine/ carries it opaquely (ScheduledBatch.spec, read only as engine/batch.py's DecodePlan); the
worker reads it as spec/inputs.py's SpecInputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecPlan:
    """What speculative decoding adds to a batch (spec/policy.py fills it)."""
    decode: bool = False        # a draft/verify step of decoding requests (else a prefill batch)
    chain: int = 0              # decode: draft tokens per request (k, or 0: a chain-0 step under load)
    draft_lag: list[int] = field(default_factory=list)    # decode: tokens each request's draft has not read
    length_cap: list[int] = field(default_factory=list)   # decode: each request's length (prompt + outputs) at its end
    draft_next: list[int] = field(default_factory=list)   # prefill: the token after each chunk (-1: sampled)
    draft_skip: bool = False    # prefill: the draft model does not read these chunks (under load)
    cached_tokens: list[tuple[int, list[int]]] = field(default_factory=list)  # prefill: (row, tokens) of
                                # cached prefixes a draft that reads tokens has not seen (on_cached)
    no_decode: bool = False     # prefill: no request of it decodes here (each ends with its first token)
    yield_at: int | None = None  # decode: the launch's rounds stop once arrivals pass this count (Arrivals)
    gate_rows: int = 0          # greedy decodes the gate chose this launch's mode for: in it, or (a prefill
                                # batch) waiting for it; 0: the gate learns nothing from it (spec/gate.py)
