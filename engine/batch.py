"""What the scheduler hands to the model runner (a ScheduledBatch) and gets back (a StepOutput).
Plain data: no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.messages import SamplingParams
from engine.request import Request


@dataclass
class SeqWork:
    req: Request
    row: int
    start: int          # first position fed (speculative decode: an upper bound; the device knows)
    q_len: int          # tokens fed
    future_id: int = 0  # > 0 when this sequence samples; its output's future-map slot
    last_chunk: bool = False
    decode: bool = False  # a decode (plain or speculative), not a prompt chunk
    noise_key: int = 0  # seeded sampling: what, besides the seed, fixes this step's random draws

    @property
    def samples(self) -> bool:
        return self.future_id > 0


class DecodePlan(Protocol):
    """What a decode policy adds to a batch (DecodePolicy.new_plan: spec/plan.py SpecPlan). engine/
    carries it to the decoding (Decoding.plan_inputs) and reads only these two fields."""
    decode: bool                # a draft/verify step of decoding requests (else a prefill batch)
    chain: int                  # decode: draft tokens per request


@dataclass(frozen=True)
class Admission:
    """A request admitted into a batch, for the trace: the tokens it knew then (its prompt; with its
    outputs so far when it is recomputed after a retraction) and how many of them the prefix cache held."""
    rid: str
    known: int
    cached: int


@dataclass
class ScheduledBatch:
    step: int
    seqs: list[SeqWork]
    input_ids: list[int]        # flattened over seqs; -f means "the token in future slot f"
    table_rows: list[int] = field(default_factory=list)    # request->slot table entries this batch sets:
    table_pos: list[int] = field(default_factory=list)     #   table[row, pos] = slot, for every newly
    table_slots: list[int] = field(default_factory=list)   #   allocated position
    sample_params: list[SamplingParams] = field(default_factory=list)   # one per sampling seq
    spec: DecodePlan | None = None                         # the decode policy's plan (with speculation)
    idle: bool = False          # DP attention: no rows, run only to keep this rank's collectives in step
    admitted: list[Admission] = field(default_factory=list)    # requests this batch admitted (the trace's)
    steps: int = 1              # decode steps run back to back (--num-scheduler-steps): plain decodes
                                # feed one token each, then their own last; speculative ones draft
                                # and verify again from what the round before accepted

    @property
    def is_spec_decode(self) -> bool:
        return self.spec is not None and self.spec.decode

    @property
    def chain(self) -> int:
        return self.spec.chain if self.spec else 0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def sampling(self) -> list[SeqWork]:
        return [s for s in self.seqs if s.samples]

    @property
    def max_q(self) -> int:
        return max(s.q_len for s in self.seqs)

    @property
    def max_kv(self) -> int:
        return max(s.start + s.q_len for s in self.seqs)


@dataclass
class StepOutput:
    """What a finished batch produced, on the host: per sampling seq, the run of tokens
    it emits (one token, or a speculative step's accepted tokens plus the bonus)."""
    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    rounds: list[list[int]] | None = None     # speculative steps of a launch: each seq's run length a round

    def rounds_of(self, i: int, launched: int) -> int:
        """The steps that gave seq i output: its rounds of a multi-round speculative launch (fewer than
        `launched` where the launch ended early), else the launch's steps."""
        return len(self.rounds[i]) if self.rounds is not None else launched

    @classmethod
    def joined(cls, outputs: list["StepOutput"]) -> "StepOutput":
        """The rounds of a multi-round speculative launch, each seq's runs one after another."""
        def join(field: str) -> list | None:
            parts = [getattr(out, field) for out in outputs]
            return None if parts[0] is None else [sum(runs, []) for runs in zip(*parts)]
        return cls(tokens=join("tokens"), logprobs=join("logprobs"), top_logprobs=join("top_logprobs"),
                   rounds=[[len(run) for run in runs] for runs in zip(*(out.tokens for out in outputs))])
