"""Graphs captured at start-up, as SGLang does: every step serving replays (the target's decode or
verify, the draft worker's steps), at every configured batch size, chain length and key width, before
the rank reports ready, so that no request waits for a capture. The time it took goes to the log."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from devices.graphs import GraphRunner
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def planned_graphs(runner: "ModelRunner") -> list[tuple["GraphRunner", dict]]:
    """Each graph runner of the rank with the keys (and their inputs' shapes) serving may replay."""
    if runner.graphs is None:
        return []
    return runner.graphs.planned(speculative=runner.spec_tokens > 0) + runner.decoding.planned_graphs()


def capture_graphs(runner: "ModelRunner") -> int:
    """Capture what planned_graphs lists (under DP attention every rank does, in the same order: the
    target's captures are collectives); how many graphs it captured."""
    plans = planned_graphs(runner)
    if not plans:
        return 0
    start = time.perf_counter()
    with torch.inference_mode():
        captured = sum(graph_runner.capture_ahead(keys) for graph_runner, keys in plans)
    log.info("graphs: captured %d (%s) for batch sizes %s in %.2f s", captured,
             ", ".join(graph_runner.name for graph_runner, _ in plans), list(runner.graphs.settings.sizes),
             time.perf_counter() - start)
    return captured
