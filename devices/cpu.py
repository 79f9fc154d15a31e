"""CPU device: the "stream" is one worker thread that runs launched work in order.

PyTorch releases the GIL inside its kernels, so the rank loop's Python
scheduling runs while the worker computes.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from devices.base import Deferred, Device, Launched, now


class CpuDevice(Device):
    name = "cpu"
    collective_backend = "gloo"
    free_host_reads = True

    def __init__(self, index: int = 0):
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-stream")
        self.rest_error: BaseException | None = None    # from a Deferred's rest: the next launch raises it
        self.threads = self.wide_threads = torch.get_num_threads()
        self.wide_from_tokens = 0                        # 0: every launch on `threads`
        self.current_threads = 0

    def use_threads(self, threads: int, wide_threads: int, wide_from_tokens: int) -> None:
        """Intra-op threads of launched work: `wide_threads` for batches of wide_from_tokens or more
        tokens (when > 0), else `threads`.

        With overlap the rank loop keeps a core for scheduling, and small batches (one decode
        token, a short verify) run best on the rest: their many small ops gain nothing from a
        second thread. Large batches (prefill chunks, verify at load) are matrix products that
        do: on the 2-core development machine, batches of 16+ tokens on both cores made plain
        decoding at concurrency 16 1.31x faster and prefill (TTFT at concurrency 1) 1.35x,
        while the loop's own work in that time costs less than it gains
        (bench/results/wide_threads.txt, wide_threshold.txt)."""
        self.threads, self.wide_threads, self.wide_from_tokens = threads, wide_threads, wide_from_tokens

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launch(self, work: Callable[[], Any], tokens: int = 0) -> Launched:
        loop = asyncio.get_running_loop()
        launched = Launched(loop.create_future())
        wide = 0 < self.wide_from_tokens <= tokens
        threads = self.wide_threads if wide else self.threads

        def timed() -> None:
            launched.started = now()
            if threads != self.current_threads:
                torch.set_num_threads(threads)
                self.current_threads = threads
            try:
                if self.rest_error is not None:
                    error, self.rest_error = self.rest_error, None
                    raise error
                with torch.inference_mode():
                    result = work()
            except BaseException as exc:      # delivered to whoever awaits the launch
                launched.finished = now()
                loop.call_soon_threadsafe(_settle, launched.future, None, exc)
                return
            launched.finished = now()
            rest = None
            if isinstance(result, Deferred):
                result, rest = result.result, result.rest
            loop.call_soon_threadsafe(_settle, launched.future, result, None)
            if rest is not None:
                try:
                    with torch.inference_mode():
                        rest()
                except BaseException as exc:
                    self.rest_error = exc

        self.worker.submit(timed)
        return launched

    def synchronize(self) -> None:
        self.worker.submit(lambda: None).result()

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
