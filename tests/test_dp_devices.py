"""The DP-attention group's collectives put their tensors where its backend takes them (engine/dp.py):
NCCL and HCCL move device memory only, so a forward's exchanges there are of device tensors, while the
per-step agreement stays on the CPU group (gloo, host tensors). On the CPU, a stand-in for
torch.distributed refuses a tensor on the wrong side for its group (tests/device_syncs.py tells device
tensors from host ones), and checks what each collective returns against hand-made values."""
from __future__ import annotations

import types

import pytest
import torch

from engine import dp as dp_module
from engine.dp import DpGroup, exchange_device
from engine.graph_shape import GraphShape
from tests.device_syncs import PRETEND, HostSyncs

HOST = torch.device("cpu")
OTHER_COUNT = 5                      # the other rank's token count


class WrongDevice(AssertionError):
    """A collective got a tensor its backend cannot move."""


class TwoRankWorld:
    """torch.distributed for rank 0 of two, the other rank's tensors made up: all-gathers give it
    OTHER_COUNT rows of ones, all-reduces add ones. Refuses host tensors on the default group of a
    device backend and device tensors on a gloo group."""

    def __init__(self, syncs: HostSyncs):
        self.syncs, self.backend, self.calls = syncs, None, []
        self.cpu_group = object()
        self.DistBackendError = RuntimeError

    def init_process_group(self, backend, **kwargs):
        self.backend = backend

    def new_group(self, backend, **kwargs):
        assert backend == "gloo"
        return self.cpu_group

    def destroy_process_group(self):
        pass

    def check(self, tensors: list[torch.Tensor], group) -> None:
        wants_device = group is not self.cpu_group and self.backend in ("nccl", "hccl")
        for tensor in tensors:
            if self.syncs.on_device(tensor) != wants_device:
                raise WrongDevice(f"{self.backend if group is not self.cpu_group else 'gloo'} got a "
                                  f"{'device' if self.syncs.on_device(tensor) else 'host'} tensor")

    def all_gather(self, parts, tensor, group=None):
        self.check([*parts, tensor], group)
        self.calls.append(("all_gather", "cpu" if group is self.cpu_group else "default"))
        parts[0].copy_(tensor)
        if group is self.cpu_group:
            parts[1].copy_(tensor)                     # the other rank agrees with this one
        elif tensor.dim() == 1 and tensor.numel() == 1:
            parts[1].fill_(OTHER_COUNT)
        else:
            parts[1].fill_(1)

    def all_reduce(self, tensor, group=None):
        self.check([tensor], group)
        self.calls.append(("all_reduce", "default"))
        tensor.add_(1)


@pytest.fixture
def world(monkeypatch):
    syncs = HostSyncs()
    fake = TwoRankWorld(syncs)
    monkeypatch.setattr(dp_module, "dist", types.SimpleNamespace(**{name: getattr(fake, name) for name in (
        "init_process_group", "new_group", "destroy_process_group", "all_gather", "all_reduce")},
        DistBackendError=RuntimeError))
    return fake, syncs


def run_a_step(group: DpGroup, device: torch.device) -> tuple:
    """An agreement, then one forward of 3 tokens through the MoE exchanges."""
    plan = group.agree(True, False, GraphShape("decode", 3, 0, 64))
    x = torch.arange(6, dtype=torch.float32, device=device).view(3, 2)
    with group.forward_rows(3):
        counts = list(group.forward.counts)
        rows, offset = group.gather_rows(x)
        mine = group.sum_rows(rows.clone(), offset, 3)
    return plan, counts, rows, offset, mine


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_a_device_backend_exchanges_device_tensors_and_agrees_on_the_cpu(world, backend):
    fake, syncs = world
    with syncs:
        group = DpGroup(0, 2, "127.0.0.1:1", backend, PRETEND)
        plan, counts, rows, offset, mine = run_a_step(group, PRETEND)
    assert plan.run and not plan.stop and plan.graph == GraphShape("decode", 3, 0, 64)
    assert counts == [3, OTHER_COUNT] and offset == 0
    assert rows.shape == (3 + OTHER_COUNT, 2) and rows[3:].eq(1).all()       # the other rank's rows, unpadded
    assert torch.equal(mine, torch.arange(6, dtype=torch.float32).view(3, 2) + 1)
    assert fake.calls == [("all_gather", "cpu"), ("all_gather", "default"), ("all_gather", "default"),
                          ("all_reduce", "default")]
    assert group.counters.padding_tokens == OTHER_COUNT - 3


def test_gloo_exchanges_host_tensors(world):
    fake, syncs = world
    with syncs:
        group = DpGroup(0, 2, "127.0.0.1:1", "gloo")
        _, counts, _, _, _ = run_a_step(group, HOST)
    assert counts == [3, OTHER_COUNT] and group.device == HOST


def test_the_exchange_device_follows_the_backend():
    assert exchange_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert exchange_device("gloo", torch.device("cuda", 1)) == HOST      # gloo beside CUDA tensors: counts on the host
