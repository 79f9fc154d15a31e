"""Accelerators with streams and events (CUDA, NPU): launch enqueues kernels on the
rank's stream from the loop thread (asynchronous), records an event, and a helper
thread waits for the event and resolves the future on the loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from devices.base import Deferred, Device, Launched, now, settle


class StreamDevice(Device):
    """Subclasses set `module` (torch.cuda / torch.npu) and `name`."""

    module: Any

    def __init__(self, index: int = 0):
        self.index = index
        self.module.set_device(index)
        self.stream = self.module.Stream()
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-events")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.name, self.index)

    def order_after_setup(self) -> None:
        self.stream.wait_stream(self.module.current_stream(self.index))

    def launch(self, work: Callable[[], Any], always: Callable[[], None] | None = None) -> Launched:
        loop = asyncio.get_running_loop()
        launched = Launched(loop.create_future())
        launched.started = now()
        try:
            result, event = self.enqueue(work, always)
        except Exception as exc:       # raised while enqueuing: the awaiting loop gets it
            launched.finished = now()
            launched.future.set_exception(exc)
            return launched

        def wait() -> None:
            try:
                event.synchronize()         # raises if the device reports an error for the work
            except BaseException as exc:
                launched.finished = now()
                loop.call_soon_threadsafe(settle, launched.future, None, exc)
                return
            launched.finished = now()
            loop.call_soon_threadsafe(settle, launched.future, result, None)

        self.waiter.submit(wait)
        return launched

    def enqueue(self, work: Callable[[], Any], always: Callable[[], None] | None = None) -> tuple[Any, Any]:
        """Queue work on the rank's stream and record its completion event."""
        with torch.inference_mode(), self.module.stream(self.stream):
            if always is not None:
                always()
            result = work()
            event = self.module.Event()
            event.record(self.stream)
            if isinstance(result, Deferred):      # queued after the event: the result does not wait for it
                result.rest()
                result = result.result
        return result, event

    def mark(self) -> Any:
        event = self.module.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        self.stream.synchronize()

    def memory_stats(self) -> tuple[int, int] | None:
        free, total = self.module.mem_get_info(self.index)
        return int(free), int(total)

    def close(self) -> None:
        self.waiter.shutdown(wait=True, cancel_futures=True)

