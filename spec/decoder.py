"""Speculative decoding as the model runner's decoding (engine/decoding.py): what a speculative
worker (spec/base.py) adds around the target's steps. It makes its CPU-side policy (spec/policy.py),
turns the policy's plan into its step inputs (spec/inputs.py), seeds the rows whose prompt is
complete, runs draft/verify/accept decode steps (several rounds a launch), lets the draft read
prompt chunks and plain decodes after the target's forward, and runs idle steps (DP attention).
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

from devices.base import Deferred
from engine.batch import ScheduledBatch
from engine.decoding import Decoding, Forward, nothing
from engine.models.attention import build_attention_batch
from engine.models.base import ModelOutput
from engine.step import StepInputs, StepResult
from spec.arrivals import Arrivals
from spec.inputs import SpecInputs, long_tensor, round_inputs

if TYPE_CHECKING:
    from devices.graphs import GraphRunner
    from engine.launch_budget import LaunchBudget
    from engine.models.attention import AttentionBatch
    from spec.policy import SpeculativeDecoding


class SpecDecoder(Decoding):
    plain_decode_graphs = False      # the draft reads the forward of plain decodes
    catches_up = False         # the draft can skip prefill batches and read what it missed later
    falls_behind = False       # it can skip reading a batch, whose requests then never draft again (policy's `behind`)
    reads_tokens = False       # it drafts from the request's tokens, kept per row (not per KV slot)
    graphs = None              # its captured draft steps (spec/draft_graphs.py), where graphs are on
    kv_len: torch.Tensor       # per row: tokens of the request in the KV cache (spec/base.py)
    bonus: torch.Tensor        # per row: the last emitted token, not yet in the cache
    trims: bool                # chains are trimmed per row
    arrivals: Arrivals         # prompts queued, counted by the policy it makes: its launches yield to them

    @abstractmethod
    def decode_step(self, inp: StepInputs) -> StepResult:
        """On the stream: one draft/verify/accept step of the batch's rows."""

    @abstractmethod
    def after_prefill(self, inp: StepInputs, input_ids: torch.Tensor, attn: "AttentionBatch",
                      out: "ModelOutput", sampled: torch.Tensor) -> None:
        """On the stream, after a prefill batch sampled: seed the rows whose prompt is now complete."""

    @abstractmethod
    def rows_ended(self, inp: StepInputs) -> bool:
        """Has every row of the step emitted all its request may?"""

    def policy(self, steps: int, budget: "LaunchBudget") -> "SpeculativeDecoding":
        from spec.gate import SpecGate
        from spec.policy import SpeculativeDecoding
        args = self.args
        gate = SpecGate() if args.adaptive_speculation(self.target.device.name) else None
        # under DP attention every rank makes the same model calls a step: the draft reads what any rank runs
        falls_behind = self.falls_behind and not args.enable_dp_attention
        return SpeculativeDecoding(args.num_steps + 1, args.spec_off_batch_size, self.catches_up, rounds=steps,
                                   budget=budget, gate=gate, draft_falls_behind=falls_behind,
                                   arrivals=self.arrivals, draft_reads_tokens=self.reads_tokens)

    def plan_inputs(self, batch: ScheduledBatch) -> SpecInputs:
        return SpecInputs.of_batch(batch)

    def bookkeeping(self, batch: ScheduledBatch) -> Callable[[], None]:
        """Each completed prompt's length (else its first decode step drafts from a stale length,
        writing past the positions it was given slots for)."""
        prompts = [seq for seq in batch.seqs if seq.last_chunk and not seq.decode]
        if not prompts:
            return nothing
        rows = long_tensor([seq.row for seq in prompts])
        lengths = long_tensor([seq.start + seq.q_len for seq in prompts])
        dev = self.target.torch_device

        def seed() -> None:
            self.kv_len[rows.to(dev)] = lengths.to(dev)
        return seed

    def run(self, inp: StepInputs, forward: Forward) -> StepResult | Deferred:
        return self.speculative_step(inp) if inp.spec.decode else forward(inp)

    def speculative_step(self, inp: StepInputs) -> StepResult:
        """One speculative step, or inp.steps of them back to back: each round drafts and verifies
        from the lengths and bonus tokens the round before left on the device. Where the host reads
        device tensors for free (the CPU), the rounds stop once every row's request has all its tokens
        (rows_ended): a round of ended rows emits nothing the host keeps (a launch planned while the
        one before ran cannot know that its requests end there). That holds for the first round too:
        under overlap a request's last launch is followed by one planned before its end was known,
        which then runs no round at all. An all-greedy launch also starts no further round once a
        prompt has arrived since it was planned (spec/arrivals.py): the prompt waits for it."""
        if inp.steps > 1:
            rounds = []
            for i in range(inp.steps):
                if self.trims and (self.rows_ended(inp) or rounds and self.arrivals.since(inp.spec.yield_at)):
                    break
                rounds.append(self.decode_step(round_inputs(inp, i)))
            result = StepResult.of_rounds(rounds, inp.rows.numel())
        else:
            result = self.decode_step(inp)
        # each request's future: its last emitted token (the input of a plain decode that follows)
        self.target.futures.store(self.put(inp.future_ids), self.bonus[self.put(inp.rows)])
        return result

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of the step's inputs on the device, without waiting."""
        return tensor.to(self.target.torch_device, non_blocking=True)

    # ---- after the target's forward of prompt chunks and plain decodes ------------------

    def unread(self, inp: StepInputs) -> bool:
        """A batch the worker skips for good (spec/policy.py `aside`): nothing to lay out for it."""
        return inp.spec.draft_skip and self.falls_behind

    def capture_aux(self, inp: StepInputs) -> bool:
        return self.needs_aux and not self.unread(inp)

    def reads_prompt(self, inp: StepInputs) -> bool:
        """Not when none of the batch's requests decodes here (SpecPlan.no_decode), except under DP
        attention: there every rank makes the same model calls a step, whatever its rows need."""
        return self.target.dp_attention or not inp.spec.no_decode

    def after_forward(self, inp, input_ids, attn, out, sampled, result) -> StepResult | Deferred:
        """The draft reads the batch: before the result goes out where nothing sampled or the batch is
        plain decodes alone (SpecInputs.plain_decodes), else while the first tokens go out."""
        if not self.reads_prompt(inp):
            return result
        if sampled.numel() == 0 or inp.spec.plain_decodes:
            self.after_prefill(inp, input_ids, attn, out, sampled)
            return result
        return Deferred(result, lambda: self.after_prefill(inp, input_ids, attn, out, sampled))

    def read_run(self, inp: StepInputs, fed: torch.Tensor, outs: list[ModelOutput], last: torch.Tensor) -> None:
        """The worker reads a plain run as a last prompt chunk of its steps: row b fed fed[b] [steps]
        at positions start_b .. start_b + steps - 1 (the target's outputs there in `outs`, a step
        each) and its last sample `last[b]` lands at start_b + steps, its bonus. An EAGLE head reads
        the run's tokens and features, as after a prompt; a draft that catches up reads them later
        (draft_skip: standalone); the token history gets them."""
        batch, steps = fed.shape
        q_lens = torch.full((batch,), steps, dtype=torch.long)
        run = dataclasses.replace(inp, q_lens=q_lens, kv_lens=inp.kv_lens + steps - 1, max_q=steps,
                                  max_kv=inp.max_kv + steps - 1, steps=1)
        if self.unread(inp):                   # the head steps aside: it only learns where the rows stand
            self.after_prefill(run, fed.reshape(-1), None, None, last)
            return
        target, put = self.target, self.put
        attn = build_attention_batch(put(run.q_lens), put(run.kv_lens), put(inp.rows), target.req_to_slot, steps,
                                     run.max_kv, target.kv, tokens=batch * steps)
        out = ModelOutput(hidden=rows_first([o.hidden for o in outs]),
                          aux_hidden=rows_first([o.aux_hidden for o in outs]))
        self.after_prefill(run, fed.reshape(-1), attn, out, last)

    def idle_step(self, decode: bool, forward: Forward) -> StepResult | Deferred:
        """A decode step drafts and verifies the whole chain; a prefill runs the forward the draft reads."""
        chain = self.args.num_steps if decode else 0
        inp = StepInputs.empty(self.target.vocab_size, chain + 1, SpecInputs.idle(decode, chain))
        return self.speculative_step(inp) if decode else forward(inp)

    def graph_runners(self) -> list["GraphRunner"]:
        return self.graphs.runners() if self.graphs else []

    def planned_graphs(self) -> list[tuple["GraphRunner", dict]]:
        return self.graphs.planned() if self.graphs else []


def rows_first(steps: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-step outputs [B, ...] of a run as a chunk's: row b's steps one after another [B * steps, ...]."""
    return None if steps[0] is None else torch.stack(steps, dim=1).flatten(0, 1)
