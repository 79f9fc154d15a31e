"""DP attention: the ranks of a group keep their own requests and KV (attention is data-parallel)
while the MoE layers are expert-parallel across them, so every forward is a collective.

The invariant the collectives need: **every rank makes the same number of target forwards, in the
same order.** A step (a prefill batch, or a speculative step's verify) is exactly one target forward
on every rank; before each step the ranks exchange a few integers on a CPU group (does anyone have a
batch; is anyone stopping), and a rank with nothing to run then runs an idle step (no rows, the same
model calls: ModelRunner.idle_step). The draft's forwards (an EAGLE head, a dense draft) are local
and need no agreement.

Inside a forward the ranks' token counts differ: the first MoE layer all-gathers them (on the
stream, in tensors where the group's backend takes them: exchange_device), and every MoE layer then
pads its rows to the largest count, all-gathers the hidden states, applies this rank's experts to
every rank's tokens, and sums the partial outputs over the group (an all-reduce; gloo has no
reduce-scatter), keeping its own rows. A token's top-k experts are summed in the same order as on one
rank, so greedy output is that of --dp-size 1.

With graphs (engine/graph_shape.py) the exchange also carries what each rank's step could replay;
the group replays a graph only if every rank can, every rank padded to the same size, and then a
forward's token counts are known without exchanging them (padded_forwards).

Every collective has a timeout; a collective that fails means a rank of the group is gone: GroupBroken
ends this rank too, and the front restarts the whole group.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.graph_shape import GraphShape, agreed_graph, encode_for_group
from engine.stats import Stat, counter

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 30
# Backends whose collectives move device memory only (gloo moves host memory, and CUDA tensors too)
DEVICE_BACKENDS = {"nccl": "cuda", "hccl": "npu"}
HOST = torch.device("cpu")


def exchange_device(backend: str, device: torch.device) -> torch.device:
    """Where the forward's own exchanges (the token counts) put their tensors: the rank's device under
    a backend of device memory (NCCL, HCCL), the host under gloo."""
    return device if backend in DEVICE_BACKENDS else HOST


class GroupBroken(RuntimeError):
    """A collective of the DP group failed: some rank is gone. This rank must end too."""


@dataclass
class StepPlan:
    """What the group agreed for one step."""
    run: bool            # some rank has a batch: everyone launches one (an idle one if it has none)
    stop: bool           # some rank is stopping: everyone stops after this step
    graph: GraphShape | None = None     # the captured graph every rank's target forward replays (None: eager)


@dataclass
class DpCounters:
    """What keeping in step with the group cost this rank, since start (a rank without DP attention
    reports them as zeros: /metrics has them on every server)."""
    sync_seconds: float = 0.0     # in the per-step exchange
    exchanges: int = 0            # per-step exchanges, idle polling included
    steps: int = 0                # steps the group ran (this rank's real or idle forwards)
    idle_steps: int = 0           # steps run with no rows, to keep in step with the group
    padding_tokens: int = 0       # rows the MoE exchange padded to the group's largest

    def stats(self) -> list[Stat]:
        return [counter("tandem_dp_idle_steps", "DP attention: steps ranks ran with no rows, to keep in step with "
                        "their group.", self.idle_steps),
                counter("tandem_dp_padding_tokens", "DP attention: rows the MoE exchange padded to the group's "
                        "largest.", self.padding_tokens),
                counter("tandem_dp_sync_seconds", "DP attention: seconds ranks spent in the per-step exchange "
                        "(summed over ranks).", self.sync_seconds),
                counter("tandem_dp_exchanges", "DP attention: per-step exchanges, idle polling included (summed "
                        "over ranks).", self.exchanges),
                counter("tandem_dp_steps", "DP attention: steps run, idle ones included (summed over ranks).",
                        self.steps)]


class DpGroup:
    """This rank's place in a DP-attention group: the expert-parallel group (the forward's
    collectives, on the stream) and a CPU group for the per-step exchange (from the loop)."""

    def __init__(self, rank: int, size: int, init_addr: str, backend: str = "gloo",
                 device: torch.device = HOST):
        self.rank, self.size = rank, size
        self.device = exchange_device(backend, device)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=timeout)
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        self.forward = threading.local()
        self.counters = DpCounters()
        log.info("rank %d joined a DP-attention group of %d (%s)", rank, size, backend)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    # ---- the per-step exchange (CPU group) ----------------------------------------------

    def agree(self, has_batch: bool, stopping: bool, graph: GraphShape | None = None) -> StepPlan:
        """Blocking: call it from a thread (the rank awaits it without blocking its loop). `graph`: what
        this rank's batch could replay (None: it runs eagerly)."""
        start = time.perf_counter()
        mine = torch.tensor([int(has_batch), int(stopping), *encode_for_group(graph, has_batch)], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.size)]
        self.collective(dist.all_gather, everyone, mine, group=self.cpu_group)
        self.counters.sync_seconds += time.perf_counter() - start
        table = torch.stack(everyone)
        plan = StepPlan(run=bool(table[:, 0].any()), stop=bool(table[:, 1].any()),
                        graph=agreed_graph(table[:, 2:].tolist()))
        self.counters.exchanges += 1
        self.counters.steps += plan.run
        return plan

    def collective(self, op, *args, **kwargs):
        try:
            return op(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise GroupBroken(f"the DP group is broken (a rank is gone?): {exc}") from exc

    # ---- inside a forward (on the stream) ----------------------------------------------

    @contextlib.contextmanager
    def padded_forwards(self):
        """Around the target forwards of a graph step: every rank pads to the size the group agreed, so
        each forward's token counts are all this rank's (no exchange, no host read to capture)."""
        if getattr(self.forward, "padded", False):
            raise RuntimeError("padded DP forwards do not nest")
        self.forward.padded = True
        try:
            yield
        finally:
            self.forward.padded = False

    @contextlib.contextmanager
    def forward_rows(self, num_tokens: int):
        """Around one target forward: every rank's token count, for the MoE layers' padding."""
        if getattr(self.forward, "counts", None) is not None:
            raise RuntimeError("DP forwards do not nest")
        if getattr(self.forward, "padded", False):
            self.forward.counts = [num_tokens] * self.size
        else:
            # NOTE: a host read of the gathered counts (the MoE layers pad to the largest); graph steps
            # skip it (padded_forwards)
            counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
            mine = torch.tensor([num_tokens], dtype=torch.int64, device=self.device)
            self.collective(dist.all_gather, counts, mine)
            self.forward.counts = torch.cat(counts).tolist()
        self.counters.padding_tokens += max(self.forward.counts) - num_tokens
        try:
            yield
        finally:
            self.forward.counts = None

    def gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's rows [sum of counts, H] (padded to the largest in transit), and where this
        rank's rows start among them."""
        counts = self.forward.counts
        width = max(counts)
        padded = x.new_zeros(width, x.shape[1])
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.collective(dist.all_gather, parts, padded)
        rows = torch.cat([part[:count] for part, count in zip(parts, counts)])
        return rows, sum(counts[:self.rank])

    def sum_rows(self, partial: torch.Tensor, offset: int, count: int) -> torch.Tensor:
        """Sum the partial outputs of every rank's experts; this rank's rows of the result."""
        self.collective(dist.all_reduce, partial)
        return partial[offset:offset + count]


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous slice of experts rank `rank` of `size` holds (the first ranks take one more)."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
