"""CPU device: the "stream" is one worker thread that runs launched work in order.

PyTorch releases the GIL inside its kernels, so the rank loop's Python
scheduling runs while the worker computes.
"""
from __future__ import annotations

import asyncio
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from devices.base import Deferred, DeferredWorkFailed, Device, Launched, now, settle


# oneDNN's and ideep's caches of compiled products (torch's bf16 products above the native kernels'
# rows: prefill chunks) hold 1,024 each by default, and a prompt chunk of every new length adds its
# own set with its weights' working copies: a bf16 server's rank grew from 458 to 661 MB PSS over 96
# prompts at concurrency 16, and to 499 with 8 entries, 560 with 64 (float32: 553 against 536).
# Read when oneDNN first runs, so set before the model does; a user's own setting wins.
ONEDNN_CACHE_ENTRIES = "16"


def bound_onednn_caches() -> None:
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, ONEDNN_CACHE_ENTRIES)


class CpuDevice(Device):
    name = "cpu"
    collective_backend = "gloo"
    free_host_reads = True

    def __init__(self, index: int = 0):
        bound_onednn_caches()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-stream")
        self.rest_error: BaseException | None = None    # from a Deferred's rest: the next launch raises it
        self.threads = 0                                 # 0: torch's default

    def set_threads(self, threads: int) -> None:
        """Intra-op threads of the stream's work. Set in the worker thread itself, so the rank
        loop's own small torch calls keep their single thread (the model on every core of the rank
        measured faster than a core kept for the loop: docs/performance-history.md)."""
        self.threads = threads

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launch(self, work: Callable[[], Any], always: Callable[[], None] | None = None) -> Launched:
        loop = asyncio.get_running_loop()
        launched = Launched(loop.create_future())

        def timed() -> None:
            launched.started = now()
            # In the worker thread at its next launch, i.e. after the model was loaded: set before
            # that (right at start-up) the same threads ran much slower (docs/performance-history.md).
            if self.threads and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            try:
                result = self.run(work, always)
            except BaseException as exc:      # delivered to whoever awaits the launch
                launched.finished = now()
                loop.call_soon_threadsafe(settle, launched.future, None, exc)
                return
            launched.finished = now()
            rest = None
            if isinstance(result, Deferred):
                result, rest = result.result, result.rest
            loop.call_soon_threadsafe(settle, launched.future, result, None)
            if rest is not None:
                try:
                    with torch.inference_mode():
                        rest()
                except BaseException as exc:
                    self.rest_error = exc

        self.worker.submit(timed)
        return launched

    def run(self, work: Callable[[], Any], always: Callable[[], None] | None) -> Any:
        """On the worker: `always`, then `work` unless the previous launch's deferred part failed."""
        with torch.inference_mode():
            if always is not None:
                always()
            if self.rest_error is not None:
                error, self.rest_error = self.rest_error, None
                raise DeferredWorkFailed(f"work deferred from the previous launch failed: {error!r}") from error
            return work()

    def synchronize(self) -> None:
        self.worker.submit(lambda: None).result()


    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)



def lazily_committed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in anonymous memory that the OS commits a page at a time, on first write: a KV cache
    sized for 65,536 tokens holds the memory of the tokens it has held, not of all it could hold
    (the pool hands out the lowest free pages first, so the touched part stays compact)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
