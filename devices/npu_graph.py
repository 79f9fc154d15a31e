"""Ascend NPU graphs: torch.npu.NPUGraph through torch_npu, mirroring CUDA graphs.

torch_npu is imported only when an NPU graph runner is asked for (as devices/npu.py does).
"""
from __future__ import annotations

import importlib

import torch

from devices.stream_graph import StreamGraphRunner


class NpuGraphRunner(StreamGraphRunner):
    graph_class = "NPUGraph"

    def __init__(self, *args, **kwargs):
        try:
            importlib.import_module("torch_npu")          # registers torch.npu
        except ImportError as exc:
            raise RuntimeError("NPU graphs need torch_npu and an Ascend NPU driver stack") from exc
        self.module = torch.npu
        super().__init__(*args, **kwargs)
