"""A CPU stand-in for an accelerator that counts host syncs: reads of device tensors' values on the
host while a step is being launched (on CUDA/NPU, `.item()`, `bool()`, `tolist()`, `.cpu()`, a
boolean-mask index and the like each wait for the device, and the rank's loop thread launches there).

Tensors are "on the device" when they were made for PRETEND (a factory's device=, `.to()`), or computed
from such tensors; everything else is host memory, as on an accelerator (the step's inputs the CPU
built, Python numbers). PRETEND is the CPU with an index: torch runs it as the CPU, the engine sees a
device that is not `cpu` (to_device moves the sampling parameters; free_host_reads is off, so steps
keep the fixed shapes they keep on CUDA), and this mode tells the two apart by the device asked for.

What it cannot see: a tensor's `.device` is still the CPU, so a host tensor moved to "where x is"
(`.to(x.device)`) stays a host tensor here, and reads of it go uncounted.

    syncs = HostSyncs()
    with syncs:                                # setup: the engine's state is made on PRETEND
        core = build_core(args, PretendAccelerator(syncs), ...)
    ... run requests: every launch runs under syncs.counting() ...
    assert syncs.reads == []
"""
from __future__ import annotations

import threading
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from devices.base import Deferred
from devices.cpu import CpuDevice

PRETEND = torch.device("cpu", 1)
HOST = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent

# reads of a tensor's values on the host: each waits for the device
READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
# ops whose output size depends on the values: the host must read them first
VALUE_SIZED = {torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
               torch.unique, torch.Tensor.unique, torch.Tensor.argwhere, torch.argwhere}
# sized by a tensor of counts unless output_size says the total
REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
DEVICE_OF = torch.Tensor.device.__get__


class HostSyncs(TorchFunctionMode):
    """Marks device tensors and, inside counting(), records every host read of one (`reads`: what,
    and where in the project's code)."""

    def __init__(self):
        super().__init__()
        self.marked: dict[int, weakref.ref] = {}
        self.reads: list[str] = []
        self.device_ops = 0                # ops on device tensors seen while counting: the harness saw the launches
        self.counting_threads: set[int] = set()
        self.lock = threading.Lock()

    # ---- marks ---------------------------------------------------------------------------------

    def on_device(self, value: Any) -> bool:
        ref = self.marked.get(id(value)) if isinstance(value, torch.Tensor) else None
        return ref is not None and ref() is value

    def mark(self, value: Any) -> None:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                key = id(tensor)
                with self.lock:
                    self.marked[key] = weakref.ref(tensor, lambda _, key=key: self.marked.pop(key, None))

    # ---- counting ------------------------------------------------------------------------------

    def counting(self, work: Callable[[], Any]) -> Any:
        """Run `work` (a launch, on the stream's thread) with this mode on, recording host reads."""
        me = threading.get_ident()
        self.counting_threads.add(me)
        try:
            with self:
                return work()
        finally:
            self.counting_threads.discard(me)

    def record(self, what: str) -> None:
        if threading.get_ident() not in self.counting_threads:
            return
        here = next((f"{Path(f.filename).relative_to(REPO)}:{f.lineno}" for f in reversed(traceback.extract_stack())
                     if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename and ".venv" not in f.filename),
                    "?")
        self.reads.append(f"{what} at {here}")

    # ---- the mode -------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_OF:                      # a device tensor says where it is: code places what it makes there
            return PRETEND if self.on_device(args[0]) else func(*args, **kwargs)
        inputs = tree_flatten((args, kwargs))[0]
        device_inputs = any(self.on_device(t) for t in inputs)
        self.check(func, args, kwargs, device_inputs)
        if device_inputs and threading.get_ident() in self.counting_threads:
            self.device_ops += 1
        result = func(*args, **kwargs)
        if func in MOVES:
            return self.moved(args, kwargs, result)
        if device_inputs or pretend(kwargs.get("device")):
            self.mark(result)
        return result

    def check(self, func, args: tuple, kwargs: dict, device_inputs: bool) -> None:
        """Record `func` if it reads a device tensor on the host."""
        name = getattr(func, "__name__", str(func))
        if func in READS and self.on_device(args[0]):
            self.record(name)
        elif func in VALUE_SIZED and device_inputs:
            self.record(name)
        elif func in REPEATS and "output_size" not in kwargs and self.on_device(repeats(args, kwargs)):
            self.record(f"{name} without output_size")
        elif func in INDEXING and any(self.on_device(t) and t.dtype == torch.bool for t in tree_flatten(args[1])[0]):
            self.record(f"{name} with a boolean mask")
        elif func in MOVES and self.on_device(args[0]) and target(args, kwargs) == HOST \
                and not kwargs.get("non_blocking", False):
            self.record("a blocking copy to the host")

    def moved(self, args: tuple, kwargs: dict, result: Any) -> Any:
        """`.to()`: to PRETEND gives a device tensor (a copy, as on an accelerator: the CPU's `.to()` may
        return the host tensor itself), to the host a host tensor; anything else keeps the mark."""
        source, where = args[0], target(args, kwargs)
        if pretend(where):
            copy = result.clone() if result is source else result
            self.mark(copy)
            return copy
        if where == HOST:
            return result
        if self.on_device(source):
            self.mark(result)
        return result


def repeats(args: tuple, kwargs: dict) -> Any:
    """repeat_interleave's `repeats` (None: the one-argument form, which is value-sized too)."""
    return kwargs.get("repeats", args[1] if len(args) > 1 else args[0])


def pretend(device: Any) -> bool:
    try:
        return device is not None and torch.device(device) == PRETEND
    except (TypeError, RuntimeError):
        return False


def target(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `.to()` / `.cuda()` call moves to (None: it keeps the tensor's)."""
    for value in (kwargs.get("device"), *args[1:]):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    return None


class PretendAccelerator(CpuDevice):
    """The CPU device, seen by the engine as an accelerator: its tensors live on PRETEND, its host reads
    are not free (fixed shapes), and every launch runs under `syncs.counting`."""

    name = "cpu"
    free_host_reads = False

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    @property
    def torch_device(self) -> torch.device:
        return PRETEND

    def run(self, work, always):
        result = self.syncs.counting(lambda: super(PretendAccelerator, self).run(work, always))
        if isinstance(result, Deferred):          # its rest runs on the stream too (on CUDA: enqueued by the loop)
            rest = result.rest
            result = Deferred(result.result, lambda: self.syncs.counting(rest))
        return result
