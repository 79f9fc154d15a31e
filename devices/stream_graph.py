"""Graphs of accelerators with streams (CUDA, NPU): subclasses name the torch module and its graph
class. Every graph of a device allocates from one memory pool: a graph's intermediates are dead once
its replay has run, and its outputs are copied into static buffers allocated outside the pool, so
graphs replayed one after another on the rank's stream can share that memory in any order.
"""
from __future__ import annotations

from typing import Any, Callable

from devices.graphs import GraphRunner


class StreamGraphRunner(GraphRunner):
    """Subclasses set `module` (torch.cuda / torch.npu) and `graph_class` (the name of its graph type)."""

    module: Any
    graph_class: str
    pools: dict[tuple[str, str], Any] = {}          # (backend, device): the pool its graphs share
    capture_streams: dict[tuple[str, str], Any] = {}

    def shared(self, table: dict, make: Callable[[], Any]) -> Any:
        key = (self.settings.backend, str(self.settings.device))
        if key not in table:
            table[key] = make()
        return table[key]

    def create(self) -> Any:
        return getattr(self.module, self.graph_class)()

    def capture(self, handle: Any, body: Callable[[], None]) -> None:
        """Warm up on a side stream (lazy initialisations of libraries happen outside the graph), then
        record. thread_local: the helper thread that waits on the rank's events may go on meanwhile."""
        stream = self.shared(self.capture_streams, self.module.Stream)
        current = self.module.current_stream()
        stream.wait_stream(current)
        with self.module.stream(stream):
            body()
        current.wait_stream(stream)
        pool = self.shared(self.pools, self.module.graph_pool_handle)
        with self.module.graph(handle, pool=pool, stream=stream, capture_error_mode="thread_local"):
            body()

    def replay(self, handle: Any, body: Callable[[], None]) -> None:
        handle.replay()

    def release(self, handle: Any) -> None:
        handle.reset()
