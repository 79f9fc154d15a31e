"""Graphs are captured at start-up (engine/graph_capture.py), as SGLang does: with --enable-cpu-graph
the rank's engine holds, before its first request, a graph for every configured batch size of every
step serving replays (every chain length a step can have, every key width), the log says how many
and how long it took, and serving then replays them without capturing one more. The reference for
the key widths is key_width itself over every sequence length."""
from __future__ import annotations

import asyncio
import logging

import pytest

from devices.base import create_device
from engine.args import parse_args
from engine.graph_shape import key_width, key_widths
from engine.messages import SamplingParams
from engine.rank import build_core
from tests.engine_harness import ALGORITHMS
from tests.test_graphs import BASE, GRAPHS_ON, complete, prompts

SIZES = (2, 4)                      # GRAPHS_ON's --cuda-graph-bs


@pytest.mark.parametrize("page_size, table_width", [(1, 2057), (4, 2064), (48, 4096), (1, 40), (16, 64)])
def test_the_start_up_widths_are_every_width_a_step_can_read(page_size, table_width):
    every = sorted({key_width(longest, page_size, table_width) for longest in range(1, table_width + 1)})
    assert key_widths(page_size, table_width) == every


def expected_keys(algorithm: str, chain: int, widths: list[int]) -> dict[str, set]:
    """(size, key) of every graph serving may replay, per runner."""
    def keyed(chains) -> set:
        return {(size, (c, width)) for size in SIZES for c in chains for width in widths}
    if algorithm == "none":
        return {"target-decode": {(size, width) for size in SIZES for width in widths}}
    return {"target-verify": keyed(range(chain + 1)), "eagle-draft": keyed(range(2, chain + 1)),
            "eagle-extend": keyed(range(chain + 1))}


@pytest.mark.parametrize("algorithm", ["none", "eagle"])
def test_graphs_exist_before_the_first_request_and_serving_captures_no_more(algorithm, caplog):
    caplog.set_level(logging.INFO, logger="engine.graph_capture")
    device = create_device("cpu")
    core = build_core(parse_args(BASE + ALGORITHMS[algorithm] + GRAPHS_ON), device, eos_ids=frozenset())
    runner = core.runner
    widths = sorted({key_width(n, runner.target.page_size, runner.target.table_width)
                     for n in range(1, runner.target.table_width + 1)})
    expected = expected_keys(algorithm, runner.spec_tokens - 1, widths)
    captured = {graphs.name: dict(graphs.graphs) for graphs in runner.graph_runners()}
    assert {name: set(graphs) for name, graphs in captured.items()} == expected
    total = sum(len(keys) for keys in expected.values())
    assert any(f"graphs: captured {total} " in message and message.endswith(" s") for message in caplog.messages)

    params = [SamplingParams(max_new_tokens=10 + 3 * i, temperature=0, ignore_eos=True) for i in range(5)]

    async def serve() -> None:
        await complete(core, prompts()[:5], params)
        after = {graphs.name: dict(graphs.graphs) for graphs in runner.graph_runners()}
        assert after.keys() == captured.keys()
        for name, graphs in after.items():      # the very graphs captured at start-up, and no other
            assert graphs.keys() == captured[name].keys()
            assert all(graphs[key] is captured[name][key] for key in graphs)
        replayed = {graphs.name: sum(graphs.replays.values()) for graphs in runner.graph_runners()}
        assert replayed["target-decode" if algorithm == "none" else "target-verify"] > 0
        await core.close()
    try:
        asyncio.run(serve())
    finally:
        device.close()
