"""DP attention across two processes on one device, for bench/gpu_check.sh: each process is a rank of a
DP-attention group on the embedded MoE model, both on device 0, each with its own requests (uneven:
one rank idles while the other finishes); their greedy outputs must equal one engine's without DP
attention. The group takes the device's own backend where it allows two ranks on one device (recent
NCCL refuses them: "Duplicate GPU detected"), else gloo beside device tensors; the result says which,
and why the other was not taken.

    python bench/dp_check.py --device cuda --out dp_check.json
    python bench/dp_check.py --device cpu                      # the same run on the CPU (gloo)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MOE = REPO / "models" / "tandem-moe"
DEVICE_BACKEND = {"cuda": "nccl", "npu": "hccl"}
FLAGS = ["--model-path", str(MOE), "--chunked-prefill-size", "32", "--speculative-algorithm", "none",
         "--max-total-tokens", "4096", "--max-running-requests", "8", "--dtype", "float32"]
PROMPTS = ("def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):",
           "SELECT name FROM users WHERE", "for i in range(10):")
RANKS = 2


def requests() -> list[tuple[str, list[int], int]]:
    """(id, prompt tokens, new tokens) of each request; rank r takes every second one from r."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MOE)
    return [(f"r{i}", tok.encode(text), 6 + 5 * i) for i, text in enumerate(PROMPTS)]


async def drive(core, mine: list[tuple[str, list[int], int]], dp: bool) -> dict[str, list[int]]:
    """Greedy outputs of `mine` through an engine core; under DP attention it steps until the group
    agrees that no rank has work (a rank that is done runs idle steps for the others)."""
    from engine.messages import SamplingParams
    for rid, prompt, new in mine:
        error = core.scheduler.add(rid, prompt, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        assert error is None, error
    added = {rid: core.scheduler.requests[rid] for rid, _, _ in mine}
    while True:
        await core.step()
        if (core.plan.run or core.in_flight is not None) if dp else core.busy:
            continue
        break
    await core.close()
    return {rid: list(req.output_ids) for rid, req in added.items()}


def one_engine(device_name: str) -> dict[str, list[int]]:
    """The reference: every request through one engine without DP attention."""
    from devices.base import create_device
    from engine.args import parse_args
    from engine.rank import build_core
    device = create_device(device_name, 0)
    try:
        core = build_core(parse_args([*FLAGS, "--device", device_name]), device, eos_ids=frozenset())
        return asyncio.run(drive(core, requests(), dp=False))
    finally:
        device.close()


def rank(index: int, backend: str, device_name: str, addr: str, results) -> None:
    """One rank's process: join the group on device 0, check the backend takes this device's tensors (one
    all-reduce), then serve its requests. Puts (index, outputs or None, error or None) in `results`."""
    import torch
    import torch.distributed as dist
    from devices.base import create_device
    from engine.args import parse_args
    from engine.dp import DpGroup
    from engine.rank import build_core
    device = create_device(device_name, 0)
    group = None
    try:
        group = DpGroup(index, RANKS, addr, backend, device.torch_device)
        probe = torch.ones(1, device=device.torch_device)
        dist.all_reduce(probe)
        if int(probe.item()) != RANKS:
            raise RuntimeError(f"an all-reduce of ones over {RANKS} ranks gave {probe.item()}")
        args = parse_args([*FLAGS, "--device", device_name, "--enable-dp-attention", "--dp-size", str(RANKS),
                           "--dist-init-addr", addr])
        core = build_core(args, device, eos_ids=frozenset(), dp=group)
        mine = requests()[index::RANKS]
        results.put((index, asyncio.run(drive(core, mine, dp=True)), None))
    except Exception as exc:       # reported to the parent, which tries the next backend
        results.put((index, None, f"{type(exc).__name__}: {exc}"))
    finally:
        device.close()
        if group is not None:
            group.close()


def free_addr() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def run_group(backend: str, device_name: str, timeout: float) -> tuple[dict[str, list[int]] | None, str | None]:
    """Both ranks in their own processes: every request's output, or why the group failed."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    addr = free_addr()
    procs = [context.Process(target=rank, args=(i, backend, device_name, addr, results)) for i in range(RANKS)]
    for proc in procs:
        proc.start()
    outputs, errors, deadline = {}, [], time.monotonic() + timeout
    try:
        for _ in procs:
            index, got, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            outputs.update(got or {})
            errors += [f"rank {index}: {error}"] if error else []
    except queue.Empty:
        errors.append(f"no answer from every rank in {timeout:.0f} s")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return (None, "; ".join(errors)) if errors else (outputs, None)


def backends(device_name: str, asked: str) -> list[str]:
    """The backends to try, in order: the device's own first, then gloo (auto), or the one asked for."""
    if asked != "auto":
        return [asked]
    own = DEVICE_BACKEND.get(device_name)
    return [own, "gloo"] if own else ["gloo"]


def check(device_name: str, asked: str, timeout: float) -> dict:
    start = time.monotonic()
    reference = one_engine(device_name)
    result: dict = {"device": device_name, "ranks": RANKS, "backend": None, "refused": {},
                    "equal_to_one_engine": False, "requests": len(reference),
                    "tokens": sum(len(tokens) for tokens in reference.values())}
    for backend in backends(device_name, asked):
        outputs, error = run_group(backend, device_name, timeout)
        if outputs is None:
            result["refused"][backend] = error
            continue
        result["backend"] = backend
        result["equal_to_one_engine"] = outputs == reference
        result["differing"] = sorted(rid for rid in reference if outputs.get(rid) != reference[rid])
        break
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def describe(result: dict) -> str:
    """One line for the log."""
    if result["backend"] is None:
        return f"DP attention on one {result['device']}: no backend ran it ({result['refused']})"
    why = "; ".join(f"{name} refused: {reason}" for name, reason in result["refused"].items())
    verdict = "equal to one engine" if result["equal_to_one_engine"] else f"DIFFERS in {result['differing']}"
    return (f"DP attention, {result['ranks']} processes on one {result['device']} over {result['backend']}"
            f"{f' ({why})' if why else ''}: {result['tokens']} tokens {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda", "npu"])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "hccl"])
    parser.add_argument("--timeout", type=float, default=120.0, help="Seconds a group may take.")
    parser.add_argument("--out", help="Write the result here as JSON.")
    args = parser.parse_args(argv)
    result = check(args.device, args.backend, args.timeout)
    print(describe(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["equal_to_one_engine"] else 1


if __name__ == "__main__":
    sys.exit(main())
