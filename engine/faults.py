"""A test hook that makes chosen launched steps raise, so that the failure paths of the rank
run for real (tests/test_fault_isolation.py). Off unless the environment sets it:

    TANDEM_FAULT_INJECT="rid=poison,after=2"     the first step holding a request whose id starts
                                                 with "poison" once it has 2 outputs
    TANDEM_FAULT_INJECT="step=7,times=3"         steps 7, 8 and 9 of every rank
    ...,where=stream|deferred|launch             raise in the step's work on the device stream
                                                 (default), in its deferred part (the draft's read
                                                 of a prompt, after the first tokens went out), or
                                                 on the CPU while the step is prepared
    ...,where=delay,seconds=0.05                 do not raise: the chosen steps take that much
                                                 longer on the stream (a slow node, for the
                                                 prefill/decode fault tests)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from devices.base import Deferred

ENV = "TANDEM_FAULT_INJECT"
WHERE = ("stream", "deferred", "launch", "delay")


class InjectedFault(RuntimeError):
    """Raised by a step the fault hook chose."""


@dataclass
class FaultInjector:
    rid: str | None = None
    after: int = 0
    step: int | None = None
    times: int = 1
    where: str = "stream"
    seconds: float = 0.0

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        fields = dict(part.split("=", 1) for part in text.split(",") if part)
        injector = cls(rid=fields.get("rid"), after=int(fields.get("after", 0)),
                       step=int(fields["step"]) if "step" in fields else None,
                       times=int(fields.get("times", 1)), where=fields.get("where", "stream"),
                       seconds=float(fields.get("seconds", 0.0)))
        if injector.where not in WHERE or (injector.rid is None) == (injector.step is None):
            raise ValueError(f"{ENV}={text!r}: give rid= or step=, and where= one of {WHERE}")
        return injector

    def chooses(self, batch) -> bool:
        if self.times <= 0:
            return False
        if self.step is not None:
            return batch.step >= self.step
        return any(seq.req.rid.startswith(self.rid) and len(seq.req.output_ids) >= self.after
                   for seq in batch.seqs)

    def wrap(self, batch, work: Callable[[], Any]) -> Callable[[], Any]:
        """`work`, made to raise (or wait) where this hook says when it chooses `batch`."""
        if not self.chooses(batch):
            return work
        message = f"fault injected into step {batch.step} ({self.where})"
        if self.where == "deferred":
            return self.failing_rest(work, message)
        self.times -= 1
        if self.where == "launch":
            raise InjectedFault(message)
        if self.where == "delay":
            return lambda: (time.sleep(self.seconds), work())[1]

        def failing() -> Any:
            raise InjectedFault(message)
        return failing

    def failing_rest(self, work: Callable[[], Any], message: str) -> Callable[[], Any]:
        """`work` whose deferred part raises (only a step with deferred work counts)."""
        def failing() -> Any:
            result = work()
            if not isinstance(result, Deferred) or self.times <= 0:
                return result
            self.times -= 1

            def rest() -> None:
                result.rest()
                raise InjectedFault(message)
            return Deferred(result.result, rest)
        return failing
