"""Ascend NPU device through torch_npu, mirroring CUDA via `torch.npu` (HCCL collectives).

torch_npu is imported only when this device is asked for; it cannot run on
machines without an Ascend NPU and its driver stack.
"""
from __future__ import annotations

import importlib

import torch

from devices.stream_device import StreamDevice


class NpuDevice(StreamDevice):
    name = "npu"
    collective_backend = "hccl"

    def __init__(self, index: int = 0):
        try:
            importlib.import_module("torch_npu")          # registers torch.npu
        except ImportError as exc:
            raise RuntimeError("--device npu needs torch_npu and an Ascend NPU driver stack") from exc
        self.module = torch.npu
        super().__init__(index)
