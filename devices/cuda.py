"""CUDA device: streams, events and NCCL."""
from __future__ import annotations

import torch

from devices.stream_device import StreamDevice


class CudaDevice(StreamDevice):
    name = "cuda"
    collective_backend = "nccl"
    module = torch.cuda
