"""The CPU's graph runner: the same static buffers, padding and replay as CUDA/NPU graphs, with the
step run eagerly at each replay.

Capturing records nothing (the base's first run, the warm-up, already wrote the static outputs), and a
replay runs the step again on the static inputs and copies its results into the static outputs. A
padding bug therefore shows on the CPU exactly as on a GPU: padded rows that wrote a request's KV, or
outputs cut from the wrong rows, change the greedy output.
"""
from __future__ import annotations

from typing import Any, Callable

from devices.graphs import GraphRunner


class CpuGraphRunner(GraphRunner):
    def create(self) -> Any:
        return object()

    def capture(self, handle: Any, body: Callable[[], None]) -> None:
        """Nothing to record: the warm-up run wrote the static outputs."""

    def replay(self, handle: Any, body: Callable[[], None]) -> None:
        body()

    def release(self, handle: Any) -> None:
        """Nothing is held beyond the static buffers."""
