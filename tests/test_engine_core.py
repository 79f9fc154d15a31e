"""The engine core's contract for the next capabilities, in-process on the embedded models:

- a request exported at a step boundary (its KV, the draft's KV and per-row state, the decode
  policy's record) and imported into a second engine built from the same weights continues
  exactly as the uninterrupted run, for every speculative algorithm and without speculation,
  greedy and seeded sampling, next to a request the second engine was already serving;
- an idle step (no rows) makes the same sequence of model calls as a real step, for a prefill
  batch and for a whole speculative decode step (draft, verify, extend), dense and MoE.
"""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.messages import SamplingParams
from engine.rank import build_core
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.server_harness import DENSE, MOE, REPO

NEW_TOKENS = 28
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=2**40 + 3, ignore_eos=True)
# one step a launch: a request's verify steps are then the same however its launches fall
BASE = ["--model-path", str(DENSE), "--max-total-tokens", "4096", "--max-running-requests", "4",
        "--num-scheduler-steps", "1"]


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DENSE)
    return [tok.encode(CODE_PROMPTS[i]) for i in (2, 4)]


class Engine:
    """An engine core on its own CPU device, driven step by step."""

    def __init__(self, flags: list[str]):
        self.device = CpuDevice()
        self.core = build_core(parse_args(flags), self.device, eos_ids=frozenset())

    def add(self, rid: str, ids: list[int], params: SamplingParams):
        assert self.core.scheduler.add(rid, ids, params) is None
        return self.core.scheduler.requests[rid]

    async def run_until(self, done, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if done():
                return
            await self.core.step()
        raise AssertionError("the engine did not get there")

    async def finish(self) -> None:
        await self.run_until(lambda: not self.core.busy)

    def close(self) -> None:
        self.device.close()


async def uninterrupted(flags: list[str], prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """The outputs and the decode steps they took (speculative steps: fewer than tokens)."""
    engine = Engine(flags)
    try:
        req = engine.add("whole", prompt, params)
        await engine.finish()
        return req.output_ids, engine.core.scheduler.policy.verify_steps(req)
    finally:
        engine.close()


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "standalone", "ngram"])
async def test_the_draft_reads_no_prompt_that_ends_with_its_first_token(algorithm, prompts):
    """max_tokens 1: the first token is all a request gets, so its prefill is not followed by the
    speculative worker's pass over the prompt (which would hold up the batch behind it); an exported
    request (a prefill node's, whose draft KV leaves with it) and one that decodes still get theirs;
    the outputs are plain decoding's. (The prefix cache is off: a prompt sent again would be read from it.)"""
    engine = Engine(BASE + ALGORITHMS[algorithm] + ["--disable-radix-cache"])
    worker, read = engine.core.runner.decoding, []
    after_prefill = worker.after_prefill

    def counted(inp, *rest):
        read.append(int(inp.q_lens.sum()))
        return after_prefill(inp, *rest)
    worker.after_prefill = counted
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    try:
        alone = engine.add("one", prompts[0], one)
        await engine.finish()
        engine.device.synchronize()            # the draft's pass runs after the first token is out
        assert read == [] and len(alone.output_ids) == 1
        engine.add("exported", prompts[0], one).exported = True       # as PrefillExporter.add marks it
        await engine.finish()
        engine.device.synchronize()
        assert sum(read) == len(prompts[0])
        decoding = engine.add("decoding", prompts[1], GREEDY)
        await engine.finish()
        assert sum(read) == len(prompts[0]) + len(prompts[1])
    finally:
        engine.close()
    plain_first, _ = await uninterrupted(BASE + ALGORITHMS["none"], prompts[0], one)
    plain, _ = await uninterrupted(BASE + ALGORITHMS["none"], prompts[1], GREEDY)
    assert alone.output_ids == plain_first and decoding.output_ids == plain


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
async def test_an_exported_request_continues_exactly_on_another_engine(algorithm, params, prompts):
    flags = BASE + ALGORITHMS[algorithm]
    reference, reference_steps = await uninterrupted(flags, prompts[0], params)
    neighbour_reference, _ = await uninterrupted(flags, prompts[1], GREEDY)
    source, dest = Engine(flags), Engine(flags)
    try:
        moving = source.add("moving", prompts[0], params)
        await source.run_until(lambda: len(moving.output_ids) >= 6)
        await source.core.drain()                                # a step boundary: nothing in flight
        state = await source.core.export_request("moving")
        assert state.kv_len == moving.kv_len == moving.known_len - 1
        source.core.scheduler.abort("moving", "abort")
        assert source.core.scheduler.pool.used_slots == 0

        neighbour = dest.add("neighbour", prompts[1], GREEDY)    # dest is busy with its own request
        await dest.run_until(lambda: len(neighbour.output_ids) >= 3)
        error = await dest.core.import_request("moving", moving.input_ids, params, moving.output_ids, state)
        assert error is None
        moved = dest.core.scheduler.requests["moving"]
        await dest.finish()
        assert moved.output_ids == reference
        # the same drafts were accepted: the draft state came along (greedy output alone would not show it)
        assert dest.core.scheduler.policy.verify_steps(moved) == reference_steps
        if algorithm != "none":
            assert reference_steps < NEW_TOKENS - 1
        assert neighbour.output_ids == neighbour_reference
        assert dest.core.scheduler.pool.used_slots == 0
    finally:
        source.close()
        dest.close()


def test_the_exported_state_holds_what_each_algorithm_needs(prompts):
    async def export(algorithm: str):
        engine = Engine(BASE + ALGORITHMS[algorithm])
        try:
            req = engine.add("r", prompts[0], GREEDY)
            await engine.run_until(lambda: len(req.output_ids) >= 2)
            await engine.core.drain()
            return await engine.core.export_request("r"), engine.core.runner
        finally:
            engine.close()
    for algorithm in ALGORITHMS:
        state, runner = asyncio.run(export(algorithm))
        layers, kv_heads, head_dim = runner.model.kv_layout()
        assert len(state.target_kv) == layers and state.target_kv[0].shape == (2, state.kv_len, kv_heads, head_dim)
        has_draft_kv = algorithm in ("eagle", "eagle3", "standalone")
        assert bool(state.draft_kv) == has_draft_kv
        assert bool(state.draft_row) == algorithm.startswith("eagle")      # hidden state and first draft
        assert ("steps_launched" in state.record) == (algorithm != "none")


class CallLog:
    """Every module forward of the given models, by name, with the rows it saw (torch's forward hooks)."""

    def __init__(self, models: dict[str, torch.nn.Module]):
        self.calls: list[tuple[str, int]] = []
        self.handles = []
        for prefix, model in models.items():
            for name, module in model.named_modules():
                if name.count(".") <= 2:         # layers and their parts; deeper ones repeat them
                    self.handles.append(module.register_forward_hook(self.hook(f"{prefix}.{name}")))

    def hook(self, name: str):
        def record(module, args, output):
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else -1
            self.calls.append((name, rows))
        return record

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def models_of(runner) -> dict[str, torch.nn.Module]:
    models = {"target": runner.model}
    worker = runner.decoding
    if runner.spec_tokens:
        draft = getattr(worker, "head", None) or getattr(worker, "draft_model", None)
        if draft is not None:
            models["draft"] = draft
    return models


IDLE_CASES = {
    "dense-none": ["--model-path", str(DENSE), "--speculative-algorithm", "none"],
    "dense-eagle": ["--model-path", str(DENSE), "--speculative-algorithm", "eagle"],
    "dense-eagle3": ["--model-path", str(DENSE), "--speculative-algorithm", "eagle3"],
    "dense-standalone": ["--model-path", str(DENSE), "--speculative-algorithm", "standalone"],
    "dense-ngram": ["--model-path", str(DENSE), "--speculative-algorithm", "ngram"],
    "moe-eagle": ["--model-path", str(MOE), "--speculative-algorithm", "eagle", "--speculative-draft-model-path",
                  str(REPO / "models" / "tandem-moe-eagle")],
    "moe-none": ["--model-path", str(MOE), "--speculative-algorithm", "none"],
}


def test_moe_layers_never_run_as_one_native_call():
    """The fused dense layer (engine/models/llama.py: native_weights) skips the layer's module calls;
    a MoE layer must keep them (DP-attention ranks join collectives inside its MLP)."""
    from engine.models.loader import load_model

    moe, _ = load_model(MOE, torch.float32, "cpu", "auto")
    dense, _ = load_model(DENSE, torch.float32, "cpu", "auto")
    assert all(layer.native_weights is None for layer in moe.layers)
    if dense.layers[0].self_attn.kernels is not None:
        assert all(layer.native_weights is not None for layer in dense.layers)


@pytest.mark.parametrize("case", list(IDLE_CASES))
async def test_an_idle_step_makes_the_same_model_calls_with_no_rows(case, prompts):
    # Module by module (--cpu-kernels torch): with the native kernels a dense layer with tokens runs as
    # one call in place of its modules. MoE layers, whose calls the group's collectives follow, never
    # fuse; that is asserted below on the default path.
    flags = IDLE_CASES[case] + ["--max-total-tokens", "4096", "--max-running-requests", "4",
                                "--disable-overlap-schedule", "--speculative-disable-by-batch-size", "0",
                                "--cpu-kernels", "torch"]
    engine = Engine(flags)
    runner = engine.core.runner
    if runner.spec_tokens:
        runner.decoding.trims = False           # a whole chain every step, as ranks in lockstep run it
    log = CallLog(models_of(runner))
    kinds: list[bool] = []
    engine.core.observers.append(lambda done: kinds.append(done.batch.is_spec_decode))
    steps: list[tuple[bool, list[str]]] = []
    try:
        engine.add("r", prompts[0], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        for _ in range(3):
            log.calls.clear()
            await engine.core.step()
            engine.device.synchronize()                     # the deferred part of a prefill too
            steps.append((kinds[-1], log.names()))
        prefill_calls = steps[0][1]
        decode_calls = steps[1][1]
        assert steps[1][0] == bool(runner.spec_tokens)
        for decode, real in ((False, prefill_calls), (True, decode_calls)):
            log.calls.clear()
            await engine.device.launch(functools.partial(runner.idle_step, decode))
            assert log.names() == real
            assert {rows for name, rows in log.calls if rows >= 0} == {0}
    finally:
        log.close()
        engine.close()
