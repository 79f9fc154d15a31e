"""The device interface: launches run in order, their results and errors are awaitable
without blocking the loop; accelerator tests run only where the device exists."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
import torch

from devices.base import Deferred, DeferredWorkFailed, create_device
from engine.trace import OverlapMeter


async def test_cpu_stream_runs_in_order_and_does_not_block_the_loop():
    device = create_device("cpu")
    order = []

    def work(i):
        time.sleep(0.05)
        order.append(i)
        return i * i

    launched = [device.launch(lambda i=i: work(i)) for i in range(4)]
    ticks = 0
    while not launched[-1].future.done():           # the loop keeps running while the stream works
        ticks += 1
        await asyncio.sleep(0.005)
    assert [await x for x in launched] == [0, 1, 4, 9]
    assert order == [0, 1, 2, 3] and ticks > 10
    assert all(x.started <= x.finished for x in launched)
    assert all(a.finished <= b.started for a, b in zip(launched, launched[1:]))
    device.close()


async def test_cpu_stream_delivers_errors_to_the_awaiter():
    device = create_device("cpu")

    def broken():
        raise ValueError("kernel failed")

    with pytest.raises(ValueError, match="kernel failed"):
        await device.launch(broken)
    assert await device.launch(lambda: 7) == 7          # the stream survives
    device.close()


async def test_cpu_stream_delivers_a_deferred_result_before_its_rest_runs():
    device = create_device("cpu")
    order = []

    def rest(tag):
        time.sleep(0.2)
        order.append(tag)

    first = device.launch(lambda: Deferred(1, lambda: rest("rest")))
    second = device.launch(lambda: order.append("second") or 2)
    assert await first == 1 and order == []                  # delivered while the rest still runs
    assert await second == 2 and order == ["rest", "second"]   # later launches wait for the rest

    def broken():
        raise ValueError("draft failed")
    await device.launch(lambda: Deferred(3, broken))
    with pytest.raises(DeferredWorkFailed, match="draft failed") as failed:     # the next launch reports it
        await device.launch(lambda: 4)
    assert isinstance(failed.value.__cause__, ValueError)
    assert await device.launch(lambda: 5) == 5
    device.close()


async def test_cpu_stream_runs_always_first_whatever_becomes_of_the_work():
    """`always` (a step's bookkeeping) runs before the work, when the work raises, and when the work
    does not run because the previous launch's deferred part failed."""
    device = create_device("cpu")
    order = []

    def broken():
        raise ValueError("failed")
    assert await device.launch(lambda: order.append("work") or 1, always=lambda: order.append("always")) == 1
    with pytest.raises(ValueError):
        await device.launch(broken, always=lambda: order.append("always 2"))
    await device.launch(lambda: Deferred(3, broken))
    with pytest.raises(DeferredWorkFailed):
        await device.launch(lambda: order.append("skipped"), always=lambda: order.append("always 3"))
    assert order == ["always", "work", "always 2", "always 3"]
    device.close()


async def test_cpu_stream_threads_are_its_own():
    device = create_device("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(1)                              # the loop thread's, as a rank sets it
    try:
        device.set_threads(2)
        assert await device.launch(torch.get_num_threads) == 2
        assert torch.get_num_threads() == 1               # the loop thread keeps its own
    finally:
        device.close()
        torch.set_num_threads(before)


class FakeStreamModule:
    """Just enough of torch.cuda's stream and event API to run StreamDevice on the CPU; an event
    raises on synchronize while `device_error` is set, as a CUDA context reports a failed kernel."""
    device_error: str | None = None

    class Stream:
        def wait_stream(self, other) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def __init__(self, enable_timing: bool = False):
            pass

        def record(self, stream) -> None:
            pass

        def synchronize(self) -> None:
            if FakeStreamModule.device_error:
                raise RuntimeError(FakeStreamModule.device_error)

    @staticmethod
    def set_device(index: int) -> None:
        pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @classmethod
    def current_stream(cls, index: int | None = None):
        return cls.Stream()


async def test_stream_device_errors_reach_the_awaiting_loop():
    from devices.stream_device import StreamDevice

    class FakeAccelerator(StreamDevice):
        name, module = "fake", FakeStreamModule

    device = FakeAccelerator(0)
    device.order_after_setup()

    def enqueue_fails():
        raise ValueError("bad shapes")
    ran = []
    with pytest.raises(ValueError, match="bad shapes"):             # raised while enqueuing
        await asyncio.wait_for(device.launch(enqueue_fails, always=lambda: ran.append("always")), 5)
    assert ran == ["always"]                                         # queued first, whatever the work did
    FakeStreamModule.device_error = "CUDA error: an illegal memory access was encountered"
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):     # raised by event.synchronize
            await asyncio.wait_for(device.launch(lambda: 1), 5)
    finally:
        FakeStreamModule.device_error = None
    assert await asyncio.wait_for(device.launch(lambda: 2), 5) == 2
    device.close()


def test_overlap_meter_counts_cpu_time_spent_while_the_device_was_busy():
    meter = OverlapMeter()
    meter.cpu(0.0, 1.0)          # before any device work: not hidden
    meter.cpu(2.0, 3.0)          # fully inside the busy interval below
    meter.cpu(3.5, 4.5)          # half inside
    meter.device(1.5, 4.0)
    meter.device(5.0, 6.0)       # settles the last span
    assert meter.hidden_fraction == pytest.approx((1.0 + 0.5) / 3.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_cuda_stream_events_are_awaitable():
    device = create_device("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    launched = device.launch(lambda: (x @ x).sum().to("cpu", non_blocking=True))
    result = await launched
    assert torch.isfinite(result) and launched.finished >= launched.started
    start, end = None, None

    def timed():
        nonlocal start, end
        start = device.mark()
        y = x @ x
        end = device.mark()
        return y.sum()
    await device.launch(timed)
    assert device.seconds_between(start, end) > 0
    device.close()


@pytest.mark.npu
def test_npu_device_needs_torch_npu():
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="torch_npu"):
            create_device("npu")
        return
    device = create_device("npu")
    assert device.torch_device.type == "npu"


def resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def test_a_cpu_kv_cache_holds_memory_only_for_the_tokens_written():
    from engine.models.attention import KVCache
    before = resident_mib()
    kv = KVCache.allocate(8, 65536, 2, 64, torch.float32)          # 512 MiB reserved, as the default server
    reserved = resident_mib() - before
    ones, twos, rows = torch.ones(1024, 2, 64), torch.full((1024, 2, 64), 2.0), torch.arange(1024)
    start = resident_mib()
    for layer in range(8):                                          # 1,024 tokens written: 8 MiB
        kv.k[layer].index_copy_(0, rows, ones)
        kv.v[layer].index_copy_(0, rows, twos)
    written = resident_mib() - start
    assert reserved < 16 and 7 < written < 24, (reserved, written)
    assert kv.k[3].is_contiguous() and kv.v[7].shape == (65536, 2, 64)
    assert float(kv.k[5][:1024].mean()) == 1.0 and float(kv.v[5][:1024].mean()) == 2.0
    assert not kv.k[5][1024:].any() and not kv.v[7][-8:].any()     # the rest reads as zeros


def test_a_cpu_device_bounds_onednn_caches_unless_the_user_set_them(monkeypatch):
    """torch's bf16 prompt products cache compiled oneDNN products per chunk length (1,024 by
    default: 200+ MB of a bf16 rank's memory); the device sets a small bound before the model runs."""
    from devices.cpu import ONEDNN_CACHE_ENTRIES, CpuDevice
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "100")
    CpuDevice().close()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == ONEDNN_CACHE_ENTRIES
    assert os.environ["LRU_CACHE_CAPACITY"] == "100"


def test_the_http_front_starts_without_torch():
    """The front never runs a model: importing what it runs must not import torch (1.7 s and about
    300 MB of every server's start)."""
    import subprocess
    import sys
    code = ("import sys, run, server.launch, server.app, server.rank_client, server.pd.decode_client, "
            "server.pd.prefill_server, server.remote_ranks; print(sorted(m for m in ('torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
