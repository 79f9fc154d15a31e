"""Prompts that arrived while a speculative launch runs: the one value the rank loop writes and the
stream reads during a launch.

A launch of several speculative rounds (--num-scheduler-steps) holds the device for up to
--max-launch-ms, and a prompt that arrives meanwhile waits for it: speculative decodes never share
a launch with prompt chunks. Twice as long as a plain run of as many steps (a round drafts and
verifies k+1 tokens a row), so a burst's first request, speculating alone, would keep the rest of
its burst waiting for it. An all-greedy launch therefore yields: its plan records how many prompts
had arrived when it was planned (SpecPlan.yield_at), and where rounds run one by one on the host
(the CPU), the worker starts no further round once more have (spec/decoder.py). The rounds it ran
emitted what they emitted; the CPU side already takes launches that end early (a launch whose rows
all ended): it gives back the KV positions the rounds did not use. Greedy only, because round i of
a launch samples with the noise key of the request's i-th step there, and a seeded request must draw
the same keys in every run whenever prompts arrive.

A plain int: the loop only adds to it, the stream only compares it (both under the GIL).
"""
from __future__ import annotations


class Arrivals:
    def __init__(self) -> None:
        self.count = 0      # prompts queued since the server started

    def arrived(self) -> None:
        self.count += 1

    def since(self, seen: int | None) -> bool:
        """Has a prompt arrived since the count was `seen` (None: the launch does not yield)?"""
        return seen is not None and self.count != seen
