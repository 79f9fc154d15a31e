"""Speculation's statistics since start: tokens emitted per verify step and device seconds per phase,
and the table /metrics serves of them with the decode policy's plain-step counters and the adaptive
gate's estimates (engine/stats.py). Every rank keeps one; without speculation it reports zeros.
Pure Python.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.stats import COUNTER, GAUGE, MEAN, MEAN_MEASURED, Stat, counter, gauge, histogram, per_label

if TYPE_CHECKING:
    from engine.batch import ScheduledBatch, StepOutput
    from engine.policy import DecodePolicy
    from spec.gate import SpecGate

PHASES = ("draft", "verify", "extend")      # the marks a speculative step records (ModelRunner.phase_times)


class SpecStats:
    def __init__(self, spec_tokens: int):
        self.accept_hist = [0] * spec_tokens        # verify steps that emitted 1 .. k+1 tokens
        self.phase_seconds: dict[str, float] = {}

    def count(self, batch: "ScheduledBatch", output: "StepOutput") -> None:
        """The accept lengths of a processed step (plain steps are the policy's: off_steps, gate_steps)."""
        if not (batch.is_spec_decode and batch.chain):
            return
        for lengths in output.rounds or [[len(run)] for run in output.tokens]:
            for length in lengths:
                self.accept_hist[length - 1] += 1

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    @property
    def steps(self) -> int:
        return sum(self.accept_hist)

    @property
    def emitted(self) -> int:
        return sum((i + 1) * count for i, count in enumerate(self.accept_hist))

    @property
    def accept_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def log_text(self, policy: "DecodePolicy") -> str:
        """What the rank's periodic log line says of speculation ("" without it)."""
        if not self.accept_hist:
            return ""
        text = f", accept length {self.accept_length:.2f}"
        text += f", speculation off for {policy.off_steps} steps (load)" if policy.off_steps else ""
        return text + (f", plain for {policy.gate_steps} steps (gate)" if policy.gate_steps else "")

    def stats(self, policy: "DecodePolicy") -> list[Stat]:
        return [
            gauge("tandem_spec_accept_length", "Mean accepted tokens per speculative verify step (mean over ranks).",
                  self.accept_length, MEAN),
            histogram("tandem_spec_accept_length_per_step", "Tokens emitted per speculative verify step.",
                      {i + 1: count for i, count in enumerate(self.accept_hist)}, self.emitted),
            per_label(COUNTER, "tandem_spec_phase_seconds", "Device seconds spent per speculative phase.", ("phase",),
                      {(phase,): self.phase_seconds.get(phase, 0.0) for phase in PHASES}),
            counter("tandem_spec_off_steps", "Decode steps that ran without speculation because as many requests "
                    "decoded as --speculative-disable-by-batch-size.", policy.off_steps),
            counter("tandem_spec_gate_plain_steps", "Decode steps that ran without speculation because the adaptive "
                    "gate expected it to lose at their batch size (--speculative-adaptive).", policy.gate_steps),
            *gate_stats(policy.gate)]


def gate_stats(gate: "SpecGate | None") -> list[Stat]:
    """The adaptive gate's explorations and its estimates per batch-size bucket: a request's expected
    decode tokens/s speculating and plain, and whether the bucket speculates (no estimates: gate off)."""
    estimates = gate.estimates() if gate else []
    rates = {(e.label, mode): rate for e in estimates
             for mode, rate in (("speculative", e.spec_tokens_per_s), ("plain", e.plain_tokens_per_s))}
    return [counter("tandem_spec_gate_explorations", "Decode launches the adaptive gate ran in the mode it did not "
                    "choose, to keep measuring it.", gate.explorations if gate else 0),
            per_label(GAUGE, "tandem_spec_gate_tokens_per_second", "Expected decode tokens/s of a request, by batch "
                      "size and mode, from the device time and accepted tokens measured so far.",
                      ("batch_size", "mode"), rates, MEAN_MEASURED),
            per_label(GAUGE, "tandem_spec_gate_speculating", "1 where the adaptive gate speculates at this batch "
                      "size, 0 where it decodes plainly (share of ranks).", ("batch_size",),
                      {(e.label,): e.speculating for e in estimates}, MEAN)]
