"""CUDA graphs: torch.cuda.CUDAGraph."""
from __future__ import annotations

import torch

from devices.stream_graph import StreamGraphRunner


class CudaGraphRunner(StreamGraphRunner):
    module = torch.cuda
    graph_class = "CUDAGraph"
