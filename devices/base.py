"""The device interface: one in-order stream per rank, launches whose completion is
an awaitable future, memory queries and the collective backend name.

`launch(work)` queues `work` (a function that enqueues device ops and returns
tensors) on the stream and returns at once; awaiting the returned future gives
`work`'s result once the device has finished it. The rank loop awaits without
blocking, so the CPU schedules batch N+1 while the device executes batch N.

`work` may return `Deferred(result, rest)`: the launch then resolves as soon as `result` is
ready, and `rest` runs next on the stream, before anything launched later (a prefill's first
token goes out while the draft model reads the prompt). An error in `rest` is raised by the
next launch, as `DeferredWorkFailed` (that launch's own work did not run).

Every error of launched work (raised while enqueuing it, while it runs, or by the device when
its completion is awaited) reaches whoever awaits the launch; nothing is lost in a helper thread.

`launch(work, always=...)`: `always` runs on the stream first, whatever becomes of `work`, even
when `work` does not run (the previous deferred part failed): bookkeeping that launches behind
this one rely on (a step's slot-table entries: engine/model_runner.py) must land in any case.
"""
from __future__ import annotations

import asyncio
import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch


class Launched:
    """A launched piece of device work: awaitable, with the wall-clock span it ran in."""

    def __init__(self, future: asyncio.Future):
        self.future = future
        self.started = 0.0      # perf_counter when the device began it (CPU: worker start)
        self.finished = 0.0     # perf_counter when it completed

    def __await__(self):
        return self.future.__await__()

    @classmethod
    def failed(cls, error: BaseException) -> "Launched":
        """A launch that never reached the device: awaiting it raises `error`."""
        launched = cls(asyncio.get_running_loop().create_future())
        launched.future.set_exception(error)
        return launched


class DeferredWorkFailed(RuntimeError):
    """The `rest` of the previous launch (a Deferred) raised; this launch's own work did not run."""


@dataclass
class Deferred:
    """What a launched function returns to have `result` delivered before `rest` runs."""

    result: Any
    rest: Callable[[], None]


class Device(ABC):
    name: str
    collective_backend: str
    # Work on the stream may read tensor values on the host and size what follows by them, at no
    # cost: true on the CPU (its tensors are host memory, nothing is captured in a graph). On
    # CUDA/NPU such a read would wait for the device, so steps keep fixed shapes there.
    free_host_reads = False

    @property
    @abstractmethod
    def torch_device(self) -> torch.device:
        """Where tensors of this rank live."""

    @abstractmethod
    def launch(self, work: Callable[[], Any], always: Callable[[], None] | None = None) -> Launched:
        """Queue work on the rank's stream, in order; the result is awaitable. `always`: run first,
        even where `work` does not run."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until everything launched so far has finished (start-up and tests only)."""

    def memory_stats(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, or None where there is no such notion."""
        return None


    def order_after_setup(self) -> None:
        """Make launched work wait for what model loading and KV allocation queued (call once,
        before the first launch)."""

    def set_threads(self, threads: int) -> None:
        """Host threads of the stream's work (the CPU device's torch threads; others ignore it)."""

    def mark(self) -> Any:
        """A point on the stream, for timing phases of launched work (call on the stream)."""
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        """Device time between two marks of work that has finished."""
        return end - start

    def close(self) -> None:
        """Stop helper threads."""


DEVICES = {
    "cpu": "devices.cpu:CpuDevice",
    "cuda": "devices.cuda:CudaDevice",
    "npu": "devices.npu:NpuDevice",
}


def resolve_device_name(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    return "cpu"


def create_device(name: str, index: int = 0) -> Device:
    module, cls = DEVICES[resolve_device_name(name)].split(":")
    return getattr(importlib.import_module(module), cls)(index)


def now() -> float:
    return time.perf_counter()


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve a launch's future on the loop (called through call_soon_threadsafe)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
