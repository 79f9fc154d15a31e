"""Graphs on a CUDA GPU (or an Ascend NPU), skipped without one: a captured toy step replays new
inputs, and the engine's greedy output with graphs on (the default there) equals graphs off
(--disable-cuda-graph) and plain greedy decoding, for every algorithm, with batches between the
captured sizes and above the largest, in float32 (tests/test_graphs.py runs the same on the CPU path)."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from devices.graphs import GraphSettings, Static
from tests.test_graphs import ALGORITHMS, CAPTURED, SIZES, generate

DEVICES = [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA GPU")]),
    pytest.param("npu", marks=[pytest.mark.npu, pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                                                                   reason="needs torch_npu and an Ascend NPU")]),
]
FLOAT32 = ["--dtype", "float32"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_captured_step_replays_new_inputs(device):
    if device == "npu":
        importlib.import_module("torch_npu")
    dev = torch.device(device, 0)
    table = torch.arange(10, dtype=torch.float32, device=dev) * 100

    def step(scale, x, rows):
        return {"y": x * scale + table[rows][:, None]}
    runner = GraphSettings(device, (2, 4), dev).runner(
        "toy", step, {"x": Static((2,), torch.float32), "rows": Static((), torch.long, pad=9)},
        {"y": Static((2,), torch.float32)})
    for offset in range(3):                         # captured once, then replayed with other inputs
        x = torch.arange(6, dtype=torch.float32, device=dev).view(3, 2) + offset
        rows = torch.tensor([0, 1, 2], device=dev) + offset
        assert torch.equal(runner.run(3, 2, x=x, rows=rows)["y"], x * 2 + table[rows][:, None])
    assert len(runner.graphs) == 1 and runner.replays == {4: 3}
    runner.release_all()


@functools.cache
def plain_greedy(device: str) -> list[list[int]]:
    return generate(ALGORITHMS["none"] + FLOAT32 + ["--disable-cuda-graph"], device_name=device).outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_graphs_on_and_off_give_plain_greedy_output_on_the_device(device, algorithm):
    on = generate(ALGORITHMS[algorithm] + FLOAT32 + SIZES, device_name=device)
    off = generate(ALGORITHMS[algorithm] + FLOAT32 + SIZES + ["--disable-cuda-graph"], device_name=device)
    expected = plain_greedy(device)
    assert on.outputs == expected
    assert off.outputs == expected
    assert on.accepted == off.accepted                 # no per-row trimming on accelerators: the same chains
    assert all(torch.allclose(a, b, rtol=0, atol=1e-3) for a, b in zip(on.kv, off.kv))
    assert set(on.replays) == CAPTURED[algorithm] and on.padded_rows > 0 and max(on.decode_rows) > 4
