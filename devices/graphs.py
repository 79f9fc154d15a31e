"""Graph capture and replay of a step function, behind one base; the device backends fill in four hooks.

A GraphRunner owns one step function `fn(key, **inputs) -> {name: tensor}` whose inputs and outputs
have a leading item axis (one entry per request row). It keeps static buffers for them, sized for
the largest captured batch, and one graph per (padded batch size, key), where the key is what else
fixes the shapes (a chain length, the key positions attention reads):

    run(count, key, **inputs)
      size = the smallest captured size >= count (or the size a DP-attention group agreed on)
      static inputs[:count] = inputs; [count:size] = each input's padding value
      replay the graph of (size, key), capturing it first when new
      return static outputs[:count]

Invariants the step functions and their callers keep:
  - fn has fixed shapes for a (size, key) and reads no tensor value on the host (CUDA/NPU record it once);
  - the padding values name only state no request owns (the slot table's padding row, its padding
    page: engine/model_runner.py), so padded rows never touch a request's KV or rows;
  - a graph is captured with padding in every row, so capture never touches a request's state;
  - the key fixes every input's and output's per-item shape (views of the static buffers are cut
    from the shapes of the tensors passed in);
  - static outputs are overwritten by the next replay of the same runner: read them, or copy what
    must outlive it, before that.

Backends: CUDA (torch.cuda.CUDAGraph, one memory pool shared by every graph of the device), NPU
(torch.npu.NPUGraph through torch_npu, imported only when asked), and the CPU, which replays the same
static buffers eagerly: nothing is faster there (a step's time is its kernels, not their launches), but
CI runs the padding, bucketing, replay and release logic for real.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

log = logging.getLogger(__name__)

GRAPH_RUNNERS = {
    "cpu": "devices.cpu_graph:CpuGraphRunner",
    "cuda": "devices.cuda_graph:CudaGraphRunner",
    "npu": "devices.npu_graph:NpuGraphRunner",
}
# Where --disable-cuda-graph is not given, graphs run by default on these devices; on the CPU only with
# --enable-cpu-graph (the CPU path pads batches and verifies whole chains: it is there for CI, not speed).
ON_BY_DEFAULT = {"cuda": True, "npu": True, "cpu": False}
# SGLang's default capture sizes, cut at --cuda-graph-max-bs (default: --max-running-requests).
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def capture_sizes(listed: tuple[int, ...], max_bs: int | None, max_running: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for, ascending: --cuda-graph-bs (or the defaults) up to
    --cuda-graph-max-bs and never past --max-running-requests."""
    cap = min(max_bs or max_running, max_running)
    return tuple(sorted({size for size in (listed or DEFAULT_CAPTURE_SIZES) if 0 < size <= cap}))


@dataclass(frozen=True)
class Static:
    """One static buffer: its per-item shape (the largest any key uses), dtype and padding value."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int = 0


@dataclass(frozen=True)
class GraphSettings:
    """Which backend captures, and for which batch sizes."""
    backend: str
    sizes: tuple[int, ...]
    device: torch.device

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, count: int) -> int | None:
        """The smallest captured size that holds `count` rows; None: more than the largest (run eagerly)."""
        return next((size for size in self.sizes if size >= count), None)

    def runner(self, name: str, fn: Callable[..., dict[str, torch.Tensor]], inputs: dict[str, Static],
               outputs: dict[str, Static], around: Callable[[], ContextManager] | None = None) -> "GraphRunner":
        """A runner of `fn` on this backend (imported on first use)."""
        module, cls = GRAPH_RUNNERS[self.backend].split(":")
        return getattr(importlib.import_module(module), cls)(name, fn, inputs, outputs, self, around)

    def describe(self) -> str:
        """For the start-up log line."""
        return f"{self.backend} graphs, capture sizes {list(self.sizes)} (captured at start-up)"


def graph_settings(backend: str, disabled: bool, enable_cpu: bool, listed: tuple[int, ...], max_bs: int | None,
                   max_running: int, device: torch.device) -> GraphSettings | None:
    """None where graphs are off: --disable-cuda-graph, a device without a backend, the CPU without
    --enable-cpu-graph, or no capture size left."""
    if disabled or backend not in GRAPH_RUNNERS or not (ON_BY_DEFAULT[backend] or enable_cpu):
        return None
    sizes = capture_sizes(listed, max_bs, max_running)
    return GraphSettings(backend, sizes, device) if sizes else None


@dataclass
class Captured:
    """One graph: the backend's handle, the static views it reads and the static views it writes."""
    handle: Any
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def item_shapes(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Each input's per-item shape (past the leading item axis)."""
    return {name: tuple(value.shape[1:]) for name, value in inputs.items()}


class GraphRunner(ABC):
    """One step function, its static buffers and its graphs per (padded size, key): see the module docstring."""

    def __init__(self, name: str, fn: Callable[..., dict[str, torch.Tensor]], inputs: dict[str, Static],
                 outputs: dict[str, Static], settings: GraphSettings, around: Callable[[], ContextManager] | None):
        self.name, self.fn, self.settings = name, fn, settings
        self.around = around or contextlib.nullcontext          # around every run of fn (DP: padded forwards)
        self.specs = inputs
        size, dev = settings.max_size, settings.device
        self.static_in = {n: torch.full((size, *s.shape), s.pad, dtype=s.dtype, device=dev) for n, s in inputs.items()}
        self.static_out = {n: torch.zeros((size, *s.shape), dtype=s.dtype, device=dev) for n, s in outputs.items()}
        self.graphs: dict[tuple, Captured] = {}
        self.replays: Counter[int] = Counter()      # replays per padded size
        self.padded_rows = 0                        # rows replayed that no request owned

    # ---- the device hooks ------------------------------------------------------------

    @abstractmethod
    def create(self) -> Any:
        """A new, empty graph handle."""

    @abstractmethod
    def capture(self, handle: Any, body: Callable[[], None]) -> None:
        """Warm up and record `body` (one run of the step on the static buffers) into `handle`."""

    @abstractmethod
    def replay(self, handle: Any, body: Callable[[], None]) -> None:
        """Run what `handle` recorded (`body` is the same step, for backends that run it eagerly)."""

    @abstractmethod
    def release(self, handle: Any) -> None:
        """Free what `handle` holds on the device."""

    # ---- the common logic -------------------------------------------------------------

    def can_run(self, count: int) -> bool:
        """Some captured size holds `count` rows (else the caller runs the step eagerly)."""
        return self.settings.size_for(count) is not None

    def run(self, count: int, key: Any, size: int | None = None, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step over `count` items, padded to `size` (default: the smallest captured size that holds
        them); its outputs cut back to the `count` real rows (views of the static outputs)."""
        size = size or self.settings.size_for(count)
        if size is None or size < count or size not in self.settings.sizes:
            raise ValueError(f"{self.name}: no captured size {size} for {count} rows (sizes {self.settings.sizes})")
        captured = self.graphs.get((size, key)) or self.capture_new(size, key, item_shapes(inputs))
        for name, value in inputs.items():
            view = captured.inputs[name]
            view[:count].copy_(value)
            view[count:].fill_(self.specs[name].pad)
        with self.around():
            self.replay(captured.handle, lambda: self.body(key, captured))
        self.replays[size] += 1
        self.padded_rows += size - count
        return {name: view[:count] for name, view in captured.outputs.items()}

    def capture_ahead(self, keys: dict[Any, dict[str, tuple[int, ...]]]) -> int:
        """Capture every configured size with every key of `keys` (key -> each input's per-item shape) not
        captured yet, so that serving finds them ready; how many it captured."""
        missing = [(size, key) for size in self.settings.sizes for key in keys if (size, key) not in self.graphs]
        for size, key in missing:
            self.capture_new(size, key, keys[key])
        return len(missing)

    def capture_new(self, size: int, key: Any, shapes: dict[str, tuple[int, ...]]) -> Captured:
        """Capture (size, key) with padding in every row (`shapes`: each input's per-item shape): a first
        eager run (the warm-up) gives the outputs' shapes, then the backend records the step on the
        static views."""
        start = time.perf_counter()
        views = {name: self.view(self.static_in[name], size, torch.Size(shape)) for name, shape in shapes.items()}
        for name, view in views.items():
            view.fill_(self.specs[name].pad)
        with self.around():
            produced = self.fn(key, **views)
            outputs = {name: self.view(self.static_out[name], size, value.shape[1:])
                       for name, value in produced.items()}
            for name, value in produced.items():
                outputs[name].copy_(value)
            captured = Captured(self.create(), views, outputs)
            self.capture(captured.handle, lambda: self.body(key, captured))
        self.graphs[(size, key)] = captured
        log.debug("%s: captured size %d, key %s in %.1f ms", self.name, size, key, 1000 * (time.perf_counter() - start))
        return captured

    def body(self, key: Any, captured: Captured) -> None:
        """One run of the step on the static buffers, its results written to the static outputs."""
        for name, value in self.fn(key, **captured.inputs).items():
            captured.outputs[name].copy_(value)

    @staticmethod
    def view(buffer: torch.Tensor, size: int, item_shape: torch.Size) -> torch.Tensor:
        """The first `size` items of a static buffer, each cut to `item_shape`."""
        if len(item_shape) != buffer.dim() - 1 or any(n > m for n, m in zip(item_shape, buffer.shape[1:])):
            raise ValueError(f"an item of shape {tuple(item_shape)} does not fit a static buffer {tuple(buffer.shape)}")
        return buffer[(slice(0, size), *(slice(0, n) for n in item_shape))]

    def release_all(self) -> None:
        """Release every graph (a later run captures again)."""
        for captured in self.graphs.values():
            self.release(captured.handle)
        self.graphs.clear()
