"""Graph runners (devices/graphs.py) on the CPU path, which replays the same static buffers eagerly:

- unit checks against hand-computed references: capture sizes, padding a batch to the next size,
  key-width buckets, what a DP-attention group agrees on, the flags, and a runner's capture /
  replay / release on a toy step (what it pads with, which rows come back);
- the engine in-process on the embedded dense model and its drafts: greedy output with graphs on
  equals plain greedy decoding without speculation, and graphs off (--disable-cuda-graph), for
  every algorithm, with batches between the captured sizes (padded) and larger than the largest
  (eager); the steps must really have replayed padded graphs, drafted what an eager step drafts,
  and left every KV slot a request can own as an eager run leaves it;
- DP attention on the embedded MoE model (real ranks, gloo): one request alone (the idle rank
  replays the group's graph with padding only), then uneven batches, equal to one rank without
  graphs.

Breaking the padding shows here: outputs cut from the wrong rows change the greedy output, padded
rows that write a request's KV slots change the KV cache (the first request admitted owns the
lowest slots and lives longest), a wrong draft state changes what the steps accept.
"""
from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass, field

import pytest
import torch

from devices.base import create_device
from devices.cpu import CpuDevice
from devices.graphs import GraphSettings, Static, capture_sizes, graph_settings
from engine.args import parse_args
from engine.graph_shape import ANY_GRAPH, NO_GRAPH, GraphShape, agreed_graph, encode_for_group, key_width
from engine.messages import SamplingParams
from engine.rank import build_core
from tests import test_dp_attention as dp_attention
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.server_harness import DENSE

CPU = torch.device("cpu")
SIZES = ["--cuda-graph-bs", "2", "4"]           # a batch of 3 pads to 4, of 1 to 2; 5 or more run eagerly
GRAPHS_ON = ["--enable-cpu-graph", *SIZES]
BASE = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "6"]


# ---- capture sizes, padding, key widths -------------------------------------------------

def test_capture_sizes_follow_the_flags_and_never_pass_max_running_requests():
    assert capture_sizes((), None, 64)[:5] == (1, 2, 4, 8, 12) and capture_sizes((), None, 64)[-1] == 64
    assert capture_sizes((), 16, 64) == (1, 2, 4, 8, 12, 16)
    assert capture_sizes((8, 2, 2, 32), None, 16) == (2, 8)
    assert capture_sizes((8, 2), 4, 64) == (2,)
    assert capture_sizes((8,), None, 4) == ()


def test_a_batch_pads_to_the_next_captured_size_and_larger_ones_run_eagerly():
    settings = GraphSettings("cpu", (2, 4, 8), CPU)
    assert [settings.size_for(n) for n in range(10)] == [2, 2, 2, 4, 4, 8, 8, 8, 8, None]


def test_key_widths_are_power_of_two_buckets_in_whole_pages_within_the_table():
    assert [key_width(n, 1, 4096) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]
    assert key_width(65, 48, 4096) == 144                   # 128 rounded up to whole pages of 48
    assert key_width(3000, 1, 2056) == 2056                 # never past the slot table
    assert key_width(10, 1, 40) == 40


def test_the_group_replays_a_graph_only_when_every_rank_with_a_batch_can():
    def entry(kind, rows, chain=3, width=128):
        return encode_for_group(GraphShape(kind, rows, chain, width), True)
    idle = encode_for_group(None, False)
    assert idle[0] == ANY_GRAPH and encode_for_group(None, True)[0] == NO_GRAPH
    assert agreed_graph([entry("verify", 3), entry("verify", 1, width=256)]) == GraphShape("verify", 3, 3, 256)
    assert agreed_graph([entry("verify", 2), idle]) == GraphShape("verify", 2, 3, 128)
    assert agreed_graph([entry("decode", 2, chain=0), idle, entry("decode", 5, chain=0)]) == \
        GraphShape("decode", 5, 0, 128)
    assert agreed_graph([entry("verify", 2), encode_for_group(None, True)]) is None      # one rank runs eagerly
    assert agreed_graph([entry("verify", 2), entry("verify", 2, chain=2)]) is None       # different chains
    assert agreed_graph([entry("verify", 2), entry("decode", 2, chain=3)]) is None
    assert agreed_graph([idle, idle]) is None


def test_graphs_are_on_by_default_on_accelerators_and_off_on_the_cpu():
    def settings(backend, disabled=False, enable_cpu=False, listed=()):
        return graph_settings(backend, disabled, enable_cpu, listed, None, 8, CPU)
    assert settings("cuda").sizes == (1, 2, 4, 8) and settings("npu").backend == "npu"
    assert settings("cpu") is None and settings("cpu", enable_cpu=True).backend == "cpu"
    assert settings("cuda", disabled=True) is None and settings("cpu", disabled=True, enable_cpu=True) is None
    assert settings("cuda", listed=(16,)) is None                     # no size up to --max-running-requests


def test_graph_flags_parse_as_sglang_spells_them():
    args = parse_args(["--cuda-graph-bs", "1", "2", "4", "--cuda-graph-max-bs", "2", "--disable-cuda-graph"])
    assert args.cuda_graph_bs == (1, 2, 4) and args.cuda_graph_max_bs == 2 and args.disable_cuda_graph
    assert parse_args([]).cuda_graph_bs == () and not parse_args([]).enable_cpu_graph
    for bad in (["--cuda-graph-max-bs", "0"], ["--cuda-graph-bs", "2", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="checks the refusal without torch_npu")
def test_npu_graphs_need_torch_npu_and_say_so():
    settings = GraphSettings("npu", (1,), CPU)
    with pytest.raises(RuntimeError, match="torch_npu"):
        settings.runner("toy", lambda key, x: {"y": x}, {"x": Static((), torch.float32)},
                        {"y": Static((), torch.float32)})


# ---- a runner on a toy step -----------------------------------------------------------------

def test_a_runner_pads_with_its_padding_values_replays_and_cuts_outputs_back():
    table = torch.arange(10, dtype=torch.float32) * 100         # row 9: the padding row
    seen: list[list[int]] = []

    def step(scale, x, rows):
        seen.append(rows.tolist())
        return {"y": x * scale + table[rows][:, None]}
    runner = GraphSettings("cpu", (2, 4), CPU).runner(
        "toy", step, {"x": Static((3,), torch.float32), "rows": Static((), torch.long, pad=9)},
        {"y": Static((3,), torch.float32)})
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])        # items of 2 in buffers of 3
    out = runner.run(3, 2, x=x, rows=torch.tensor([0, 1, 2]))["y"]
    assert torch.equal(out, x * 2 + torch.tensor([[0.0], [100.0], [200.0]]))
    assert seen == [[9, 9, 9, 9], [0, 1, 2, 9]]          # captured (the warm-up) on padding only, then replayed
    assert runner.replays == {4: 1} and runner.padded_rows == 1

    out_one = runner.run(1, 2, x=x[2:], rows=torch.tensor([5]))["y"]
    assert torch.equal(out_one, torch.tensor([[510.0, 512.0]])) and seen[-1] == [5, 9]
    again = runner.run(3, 2, x=x, rows=torch.tensor([3, 4, 5]))["y"]
    assert len(runner.graphs) == 2 and seen[-1] == [3, 4, 5, 9]  # (4, key 2) was not captured again
    assert torch.equal(out, again)          # static outputs: the next replay of the size overwrote them

    assert not runner.can_run(5)
    with pytest.raises(ValueError):
        runner.run(5, 2, x=torch.zeros(5, 2), rows=torch.zeros(5, dtype=torch.long))
    runner.release_all()
    assert runner.graphs == {}
    runner.run(2, 2, x=x[:2], rows=torch.tensor([0, 1]))
    assert len(runner.graphs) == 1 and seen[-2:] == [[9, 9], [0, 1]]      # captured anew


# ---- the engine in-process: graphs on and off equal plain greedy ------------------------------

@dataclass
class Run:
    outputs: list[list[int]]
    decode_rows: list[int] = field(default_factory=list)      # rows of every decoding batch, in order
    accepted: list[list[int]] = field(default_factory=list)   # drafts each row of each speculative step accepted
    replays: dict[str, dict[int, int]] = field(default_factory=dict)
    padded_rows: int = 0
    still_captured: int = 0                                   # graphs left captured after the engine closed
    kv: list[torch.Tensor] = field(default_factory=list)     # every layer's K and V (target, draft), pool slots only


def prompts() -> list[list[int]]:
    """Eight prompts, the first of 3 tokens (its request owns the lowest KV slots); with 6 running at most,
    the last two reuse rows and slots that others freed."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(CODE_PROMPTS[7])] + [tok.encode(text) for text in CODE_PROMPTS[:7]]


def budgets(count: int) -> list[SamplingParams]:
    """The first request decodes longest; the others end one by one, so the batch shrinks through every size."""
    return [SamplingParams(max_new_tokens=96 if i == 0 else 12 + 4 * i, temperature=0, ignore_eos=True)
            for i in range(count)]


async def complete(core, prompts: list[list[int]], params: list[SamplingParams], tag: str = "r") -> list[list[int]]:
    """Add the requests to the engine core and step it until they are done: their outputs."""
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert core.scheduler.add(f"{tag}{i}", prompt, p) is None
        requests.append(core.scheduler.requests[f"{tag}{i}"])
    while core.busy:
        await core.step()
    return [r.output_ids for r in requests]


def generate(flags: list[str], whole_chains: bool = False, device_name: str = "cpu") -> Run:
    """Run the prompts through the rank's engine core; whole_chains: no per-row trimming of chains
    without graphs either (the CPU trims them), so that each step drafts and verifies what a graph does."""
    args = parse_args(BASE + ["--device", device_name] + flags)
    device = create_device(device_name)
    core = build_core(args, device, eos_ids=frozenset())
    if whole_chains and core.runner.spec_tokens:
        core.runner.decoding.trims = False
    run = Run(outputs=[])

    def observe(done) -> None:
        if any(seq.decode for seq in done.batch.seqs):
            run.decode_rows.append(len(done.batch.seqs))
        if done.batch.is_spec_decode:
            run.accepted.append(done.result.accepted.tolist())
    core.observers.append(observe)


    async def complete_and_close() -> list[list[int]]:
        outputs = await complete(core, prompts(), budgets(8))
        await core.close()
        return outputs
    try:
        run.outputs = asyncio.run(complete_and_close())
    finally:
        device.close()
    runner = core.runner
    caches = [runner.kv] + ([runner.decoding.draft_kv] if runner.decoding.draft_kv else [])
    run.kv = [layer[:runner.num_slots] for cache in caches for layer in cache.k + cache.v]
    for runner in core.runner.graph_runners():
        run.replays[runner.name] = dict(runner.replays)
        run.padded_rows += runner.padded_rows
        run.still_captured += len(runner.graphs)
    return run


@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    return generate(ALGORITHMS["none"]).outputs


CAPTURED = {"none": {"target-decode"}, "eagle": {"target-verify", "eagle-draft", "eagle-extend"},
            "eagle3": {"target-verify", "eagle-draft", "eagle-extend"},
            "standalone": {"target-verify", "standalone-draft"}, "ngram": {"target-verify"}}


@pytest.mark.parametrize("algorithm, extra", [(name, []) for name in ALGORITHMS] + [("eagle", ["--page-size", "4"])],
                         ids=list(ALGORITHMS) + ["eagle-page-size-4"])
def test_graphs_on_and_off_give_plain_greedy_output(algorithm, extra, plain_greedy):
    on = generate(ALGORITHMS[algorithm] + extra + GRAPHS_ON)
    off = generate(ALGORITHMS[algorithm] + extra + GRAPHS_ON + ["--disable-cuda-graph"], whole_chains=True)
    assert on.outputs == plain_greedy
    assert off.outputs == plain_greedy
    assert on.accepted == off.accepted          # the same drafts, step by step (a wrong draft state would not
    assert off.replays == {}                    # change the output, only what is accepted)
    # every slot the pool hands out holds the same K/V (up to rounding): padded rows wrote only the padding
    # page (the embedded model's output hardly changes when they overwrite the first position's)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-3) for a, b in zip(on.kv, off.kv))
    assert set(on.replays) == CAPTURED[algorithm] and all(on.replays.values())
    assert set(on.replays["target-decode" if algorithm == "none" else "target-verify"]) == {2, 4}
    assert on.still_captured == 0               # the engine's close released them
    assert on.padded_rows > 0                   # batches between the captured sizes (padded)
    assert max(on.decode_rows) > 4              # and above the largest (eager)


# ---- DP attention: idle ranks replay the padded graph --------------------------------------

@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    """What tests/test_dp_attention.py's `outputs` gives on one rank without graphs (in-process: no
    rank to start): the first request alone, then all of them."""
    device = CpuDevice()
    core = build_core(parse_args(dp_attention.BASE + dp_attention.ALGORITHMS["none"]), device, eos_ids=frozenset())
    prompts, params = dp_attention.prompts(), dp_attention.budgets(6)

    async def alone_then_together() -> list[list[int]]:
        return await complete(core, prompts[:1], params[:1], "alone") + await complete(core, prompts, params)
    try:
        return asyncio.run(alone_then_together())
    finally:
        device.close()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["none", "eagle"])
async def test_dp_attention_with_graphs_equals_one_rank_without(algorithm, one_rank):
    flags = dp_attention.DP + dp_attention.ALGORITHMS[algorithm] + ["--dp-size", "2", *GRAPHS_ON]
    got, stats = await dp_attention.outputs(flags, dp_attention.budgets(6))
    assert got == one_rank
    assert all(s.value("tandem_graph_replays") > 0 for s in stats)              # every rank replayed graphs
    assert sum(s.value("tandem_graph_idle_replays") for s in stats) > 0        # a rank without a batch: padding only
    assert sum(s.value("tandem_graph_padded_rows") for s in stats) > 0
