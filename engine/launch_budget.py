"""How many decode steps one launch runs (--num-scheduler-steps with --max-launch-ms).

A multi-step launch saves the rank loop's, the front's and the client's per-step work, but
everything that arrives meanwhile waits for it: a new prompt's first token, an abort, the
stream's next tokens. So a launch runs only as many steps as fit in the budget, by the device
time that steps of its size measured (LaunchBudget.observe: seconds per step, per number of
rows and draft length). A size not measured yet is estimated from the nearest larger one
measured, else scaled up linearly from the largest below (a step's time grows more slowly
than its rows, so this errs on fewer steps); with nothing measured the launch runs one step,
which measures it.

Plain data in, a number out: the rank's core feeds it the spans its device reported. How
many steps a launch runs never changes what a request emits (multi-step and speculative
rounds sample with the noise keys of the plain steps they replace), only when it is seen.
"""
from __future__ import annotations

from collections import deque
from statistics import median_low

RECENT = 5              # a size's estimate: the lower median of its last RECENT launches (a slow
                        # first launch or a pause on a busy machine does not hold it back)


class LaunchBudget:
    def __init__(self, seconds: float):
        self.seconds = seconds      # 0: no cap
        self.recent: dict[tuple[int, int], deque[float]] = {}   # (rows, chain) -> seconds per step

    def observe(self, rows: int, chain: int, steps: int, seconds: float) -> None:
        """A launch of `steps` decode steps of `rows` rows took `seconds` of device time."""
        if rows < 1 or steps < 1 or seconds <= 0:
            return
        self.recent.setdefault((rows, chain), deque(maxlen=RECENT)).append(seconds / steps)

    def steps(self, rows: int, chain: int = 0) -> int:
        """Most steps of a launch of `rows` rows that fit in the budget (at least one)."""
        if not self.seconds:
            return 1 << 30
        per_step = self.estimate(rows, chain)
        return 1 if per_step is None else max(1, int(self.seconds / per_step))

    def estimate(self, rows: int, chain: int) -> float | None:
        if (rows, chain) in self.recent:            # the usual case: a size seen before
            return self.per_step_of(rows, chain)
        sizes = [r for r, c in self.recent if c == chain]
        larger = [r for r in sizes if r >= rows]
        if larger:
            return self.per_step_of(min(larger), chain)
        if sizes:
            largest = max(sizes)
            return self.per_step_of(largest, chain) * rows / largest
        return None

    def per_step_of(self, rows: int, chain: int) -> float:
        return median_low(self.recent[(rows, chain)])
