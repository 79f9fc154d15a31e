"""No host sync while a step is launched (docs: the overlap loop; on CUDA/NPU the rank's loop thread
enqueues the step, so a read of a device tensor's value there stalls the loop until the device is
done). tests/device_syncs.py stands in for an accelerator on the CPU and records every such read:

- a sampled batch (temperature, top-k, top-p, min-p, greedy and seeded rows) samples without one,
  and draws the same tokens with and without the stand-in;
- the engine with EAGLE on the stand-in (fixed shapes, eager draft, verify and extend; sampled and
  greedy requests) launches every step without one (the eager attention layout included), and emits
  what the CPU device emits with whole chains;
- the harness itself counts what it must: `.item()`, `bool()`, `tolist()`, `.cpu()`, a boolean mask of a
  device tensor, a repeat_interleave by device counts without output_size, and not host tensors or
  non-blocking copies.
"""
from __future__ import annotations

import asyncio

import torch

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.messages import SamplingParams
from engine.model_runner import to_device
from engine.rank import build_core
from engine.sampling import SamplingBatch, sample
from tests.device_syncs import HOST, PRETEND, HostSyncs, PretendAccelerator
from tests.e2e_prompts import CODE_PROMPTS
from tests.server_harness import DENSE
from tests.test_graphs import complete

VOCAB = 64
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(temperature=1.2, top_k=5),
           SamplingParams(temperature=0.7, min_p=0.2, seed=3), SamplingParams(temperature=0),
           SamplingParams(temperature=1.0, top_k=8, top_p=0.8, min_p=0.05)]


def test_the_harness_counts_host_reads_of_device_tensors_only():
    syncs = HostSyncs()

    def work() -> None:
        on_device = torch.arange(6, device=PRETEND)
        host = torch.arange(6)
        derived = on_device * 2 + host
        int(host.sum()), bool(host.any()), host[host > 2], host.tolist()               # host: free
        derived.to("cpu", non_blocking=True)                                         # the step's result copy
        moved = host.to(PRETEND)
        derived.sum().item(), bool(moved.any()), derived.tolist(), derived.cpu(), derived[derived > 4]
        moved[moved > 1] = 0
        on_device.repeat_interleave(moved), host.repeat_interleave(host)
        host.repeat_interleave(torch.ones_like(moved), output_size=6)
    syncs.counting(work)
    assert [read.split(" at ")[0] for read in syncs.reads] == [
        "item", "__bool__", "tolist", "cpu", "__getitem__ with a boolean mask", "__setitem__ with a boolean mask",
        "repeat_interleave without output_size"]
    assert all("tests/" not in read for read in syncs.reads)


def sampled_tokens(syncs: HostSyncs | None) -> torch.Tensor:
    """SAMPLED's rows sampled from fixed logits, on the stand-in (with `syncs`) or the plain CPU."""
    dev = PRETEND if syncs else HOST
    logits = torch.randn(len(SAMPLED), VOCAB, generator=torch.Generator().manual_seed(0))
    sb = SamplingBatch.build(SAMPLED, list(range(len(SAMPLED))), VOCAB, HOST)
    generator = torch.Generator().manual_seed(1)

    def launch() -> torch.Tensor:              # as on the stream: the inputs go to the device, then sample
        return sample(logits.to(dev), to_device(sb, dev), generator).to(HOST, non_blocking=True)
    return syncs.counting(launch) if syncs else launch()


def test_a_sampled_batch_samples_without_a_host_sync():
    syncs = HostSyncs()
    tokens = sampled_tokens(syncs)
    assert syncs.reads == []
    assert torch.equal(tokens, sampled_tokens(None))


FLAGS = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "6",
         "--speculative-algorithm", "eagle", "--cpu-kernels", "torch"]


def eagle_outputs(device: CpuDevice, setup: HostSyncs | None = None) -> list[list[int]]:
    """Sampled (seeded) and greedy requests through an EAGLE engine on `device`, chains never trimmed."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tok.encode(text) for text in CODE_PROMPTS[:5]]
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, **{k: getattr(p, k) for k in
                                                                    ("temperature", "top_p", "top_k", "min_p")},
                             seed=p.seed if p.seed is not None else 11 + i) for i, p in enumerate(SAMPLED)]
    args = parse_args(FLAGS)
    if setup:
        with setup:
            core = build_core(args, device, eos_ids=frozenset())
    else:
        core = build_core(args, device, eos_ids=frozenset())
    core.runner.decoding.trims = False

    async def run() -> list[list[int]]:
        greedy = [SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)] * 2
        outputs = await complete(core, prompts, params, "s") + await complete(core, prompts[:2], greedy, "g")
        await core.close()
        return outputs
    try:
        return asyncio.run(run())
    finally:
        device.close()


def test_eagle_steps_launch_without_a_host_sync_and_emit_what_the_cpu_does():
    syncs = HostSyncs()
    got = eagle_outputs(PretendAccelerator(syncs), setup=syncs)
    assert syncs.reads == []
    assert syncs.device_ops > 1000                    # the harness saw the steps' forwards, eager layout included
    assert got == eagle_outputs(CpuDevice())
