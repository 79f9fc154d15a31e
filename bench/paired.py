"""Per-round ratios of two servers measured in the same rounds, and how far their median can be trusted.

On a shared machine a server's throughput drifts by more than the differences worth measuring (a
round can run at half the speed of the one before it). Rounds alternate the servers' order, so
the two runs of one round are adjacent in time and share most of that drift: their ratio is far
steadier than a ratio of medians taken over all rounds. The interval is a bootstrap of the median
of those ratios (resampled rounds, a fixed seed so the same runs print the same interval)."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

DRAWS = 2000
LEVEL = 0.9


@dataclass(frozen=True)
class Paired:
    rounds: int
    median: float
    low: float                  # the LEVEL interval of the median
    high: float

    def record(self) -> dict:
        return {"rounds": self.rounds, "median": self.median, "low": self.low, "high": self.high,
                "level": LEVEL}


def paired(new_runs: list[dict], old_runs: list[dict], key: str) -> Paired | None:
    """new / old of `key`, round by round (runs listed in round order); None without two rounds."""
    ratios = [new[key] / old[key] for new, old in zip(new_runs, old_runs)
              if isinstance(new.get(key), (int, float)) and isinstance(old.get(key), (int, float)) and old[key]]
    if len(ratios) < 2:
        return None
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(DRAWS))
    tail = int(DRAWS * (1 - LEVEL) / 2)
    return Paired(len(ratios), statistics.median(ratios), medians[tail], medians[DRAWS - 1 - tail])
