"""Standalone-draft and n-gram speculation: greedy output identical to no speculation
through real rank processes (dense and MoE targets, overlap on and off, 8 concurrent
prompts of mixed lengths), and worker-level checks driven in-process: how many drafts
each step accepts, chunked prefill, retraction, mixed greedy / sampling batches."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.core import Finished
from engine.messages import SamplingParams
from engine.model_runner import ModelRunner
from engine.rank import build_core
from spec.ngram_worker import SINGLE_TOKEN_MATCH_DRAFTS, ngram_drafts
from tests.checkpoints import random_head, random_target
from tests.engine_harness import engine, run_batch

K = 3                       # --speculative-num-steps of every test here
NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
BASE_FLAGS = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--context-length", "512",
              "--chunked-prefill-size", "16", "--speculative-num-steps", str(K),
              "--speculative-disable-by-batch-size", "0",      # always draft, unless a test says otherwise
              "--num-scheduler-steps", "1"]    # each step observed on its own (rounds: tests/test_multi_step.py)


# ---- checkpoints ---------------------------------------------------------------------

def context_target(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    """random_target with an untied random LM head and unscaled embeddings. random_target's tied,
    sharpened embeddings make greedy decoding echo the last token, so every draft would be right;
    here the output depends on the context (it still falls into loops now and then)."""
    random_target(folder, arch=arch, seed=seed)
    weights = load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"] / 8.0
    generator = torch.Generator().manual_seed(seed + 100)
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = torch.randn(embed.shape, generator=generator)
    save_file({name: t.contiguous() for name, t in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def noisy_copy(source: Path, folder: Path, noise: float, seed: int = 7) -> Path:
    """The same model with noise on its LM head: a draft that is right only part of the time."""
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head + noise * torch.randn(head.shape, generator=generator)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("spec_workers")
    dense = context_target(base / "dense")
    moe = context_target(base / "moe", arch="moe")
    return {"dense": dense, "moe": moe,
            "dense-draft": noisy_copy(dense, base / "dense-draft", noise=0.3),
            "moe-draft": noisy_copy(moe, base / "moe-draft", noise=0.3),
            "dense-eagle": random_head(base / "dense-eagle", dense),
            "small-vocab": random_target(base / "small-vocab", vocab=256)}


def mixed_prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    """Random prompts of 3..40 tokens, one of them a repeated pattern."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 41))] for _ in range(count)]
    prompts[0] = [11, 12, 13, 14, 15] * 7
    return prompts


def spec_flags(models: dict[str, Path], arch: str, algorithm: str, draft: str | None = None) -> list[str]:
    flags = ["--model-path", str(models[arch]), "--speculative-algorithm", algorithm]
    if algorithm == "standalone":
        flags += ["--speculative-draft-model-path", str(models[draft or f"{arch}-draft"])]
        if draft == arch:       # the target as its own draft: the same weights, so not quantized either
            flags += ["--speculative-draft-quantization", "none"]
    if algorithm == "eagle":
        flags += ["--speculative-draft-model-path", str(models[f"{arch}-eagle"])]
    return flags


# ---- the rank's engine core in-process, for worker-level checks ---------------------------

def generate_in_process(flags: list[str], prompts: list[list[int]], overlap: bool = True,
                        params: list[SamplingParams] | None = None, max_steps: int = 2000,
                        widths: list[tuple[int, int]] | None = None,
                        verified_tokens: list[tuple[int, int]] | None = None,
                        kinds: list[str] | None = None):
    """Run the rank's engine core (engine/core.py: with overlap, batch N+1 is scheduled and
    launched before batch N is processed) and observe its steps through its hook. Returns the
    outputs, (accepted drafts, drafts verified) of every row of every speculative step in order (a
    row verifies the step's whole chain unless the CPU trimmed it: see ConfidenceTrim), and the
    retraction count; `widths` gets each speculative step's (chain, drafts its widest row verified),
    `verified_tokens` the rows and tokens its verify forward read, `kinds` each decoding batch's kind
    in order: "draft" (a speculative step with drafts), "chain0" (one that drafts nothing) or
    "plain" (decodes scheduled as without speculation, under load)."""
    args = parse_args(BASE_FLAGS + flags + ([] if overlap else ["--disable-overlap-schedule"]))
    drafted: list[tuple[int, int]] = []

    def observe(done: Finished) -> None:
        batch, result = done.batch, done.result
        if kinds is not None and (batch.is_spec_decode or any(seq.decode for seq in batch.seqs)):
            kinds.append(("draft" if batch.chain else "chain0") if batch.is_spec_decode else "plain")
        if not batch.is_spec_decode:
            return
        last = result.emitted[torch.arange(result.accepted.shape[0]), result.accepted]
        futures = torch.tensor([seq.future_id for seq in batch.sampling])
        assert torch.equal(core.runner.futures.tokens[futures], last)          # a plain decode's next input
        drafted.extend(zip(result.accepted.tolist(), result.drafted.tolist()))
        if widths is not None:
            widths.append((batch.chain, result.emitted.shape[1] - 1))
        if verified_tokens is not None:
            verified_tokens.append((len(batch.seqs), result.verify_tokens))   # (rows, tokens) of its verify

    async def run() -> list:
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params or [GREEDY] * len(prompts))):
            assert core.scheduler.add(f"r{i}", prompt, p) is None
            requests.append(core.scheduler.requests[f"r{i}"])
        for _ in range(max_steps):
            if not core.busy:
                return [r.output_ids for r in requests]
            await core.step()
        raise AssertionError("the engine core did not finish")

    device = CpuDevice()
    try:
        core = build_core(args, device, eos_ids=frozenset())
        core.observers.append(observe)
        outputs = asyncio.run(run())
    finally:
        device.close()
    return outputs, drafted, core.scheduler.retractions


def full_chains(steps: list[tuple[int, int]]) -> list[int]:
    """Accepted drafts of the rows that verified a whole chain (the last steps of a request draft
    only what max_new_tokens leaves room for; trimmed rows verify fewer)."""
    return [n for n, chain in steps if chain == K]


@pytest.fixture(scope="module")
def in_process_reference(models):
    cache: dict[tuple, list[list[int]]] = {}

    def reference(arch: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (arch, tuple(map(tuple, prompts)))
        if key not in cache:
            flags = ["--model-path", str(models[arch]), "--speculative-algorithm", "none"]
            cache[key] = generate_in_process(flags, prompts)[0]
        return cache[key]
    return reference


# ---- n-gram lookup -------------------------------------------------------------------

def test_ngram_drafts_continue_the_latest_longest_match():
    pad = 0
    rows = [([1, 2, 3, 4, 1, 2, 3], [4, 1, 2]),          # last 3 seen at 0: what followed, then periodic
            ([7, 8, 7, 8, 7], [8, 7, 8]),                # overlapping match: period 2 continues past the end
            ([2, 3, 7, 3, 8, 2, 3], [7, 3, 8]),          # the 2-token match wins over the later 1-token one
            ([5, 6, 9], [9, 9, 9]),                      # no earlier occurrence: repeat the last token
            ([4, 1, 2, 3, 5, 1, 2, 3], [5, 1, 2]),       # the latest of two occurrences
            ([5, 6, 1, 2, 3, 1, 2, 3], [1, 2, 3]),       # garbage past the valid end is never matched
            ([1, 5, 2, 5], [2, 5, 2])]                   # only the last token recurs: a 1-token match
    width = 12
    history = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, (tokens, _) in enumerate(rows):
        history[i, :len(tokens)] = torch.tensor(tokens)
    history[5, 8:11] = torch.tensor([1, 2, 3])
    valid = torch.tensor([len(tokens) for tokens, _ in rows])
    drafts, _ = ngram_drafts(history, valid, 3)
    assert drafts.tolist() == [want for _, want in rows]
    _, worth = ngram_drafts(history, valid, 6)
    assert worth.tolist() == [6, 6, 6, 0, 6, 6, SINGLE_TOKEN_MATCH_DRAFTS]     # by the length of the match


# ---- worker-level: acceptance --------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_standalone_with_the_target_as_draft_accepts_every_draft(models, in_process_reference, arch, overlap):
    """Same weights for draft and target: any wrong draft KV (prefill chunks, the position
    re-read after a fully accepted step) would show up as a rejected draft."""
    prompts = mixed_prompts()
    outputs, steps, _ = generate_in_process(spec_flags(models, arch, "standalone", draft=arch), prompts, overlap)
    assert outputs == in_process_reference(arch, prompts)
    assert set(full_chains(steps)) == {K} and all(n == chain for n, chain in steps)


@pytest.mark.parametrize("quantization", ["int8", "w8a8_int8"])
@pytest.mark.parametrize("algorithm", ["eagle", "standalone", "ngram"])
def test_int8_weights_speculation_is_lossless(models, algorithm, quantization):
    """--quantization int8 / w8a8_int8 (target and draft): every algorithm's greedy output is plain
    greedy decoding's on the same quantized weights (int8: the native product reads few rows for
    verify and draft steps and the dequantized product for prompt chunks, the two must agree;
    w8a8_int8: each row quantized alone, whatever its batch)."""
    prompts = mixed_prompts()
    int8 = ["--quantization", quantization]
    reference = generate_in_process(["--model-path", str(models["dense"]), "--speculative-algorithm", "none"] + int8,
                                    prompts)[0]
    outputs, steps, _ = generate_in_process(spec_flags(models, "dense", algorithm) + int8, prompts)
    assert outputs == reference
    if algorithm != "eagle":                # the random EAGLE head here drafts nothing the target accepts
        assert any(n > 0 for n, _ in steps)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_plain_steps_under_load_then_the_draft_catches_up(models, in_process_reference, overlap):
    """--speculative-disable-by-batch-size 4: while 4+ requests decode, steps draft nothing
    (accepted 0, one token each) and the draft model skips them; as requests finish, drafting
    resumes and the draft first reads the tokens it missed. With the target as its own draft
    every resumed draft must be accepted, so a wrong catch-up (positions, KV, lag) would show."""
    prompts = mixed_prompts()
    params = [SamplingParams(max_new_tokens=3 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    flags = spec_flags(models, "dense", "standalone", draft="dense") + ["--speculative-disable-by-batch-size", "4"]
    kinds: list[str] = []
    outputs, steps, _ = generate_in_process(flags, prompts, overlap, params=params, kinds=kinds)
    reference = in_process_reference("dense", prompts)
    assert outputs == [ref[:p.max_new_tokens] for ref, p in zip(reference, params)]
    assert all(n == chain for n, chain in steps)        # every draft accepted, after plain steps too
    assert kinds.index("draft") > kinds.index("plain")  # drafting resumed after plain decodes


@pytest.mark.parametrize("algorithm", ["none", "standalone", "eagle", "ngram"])
def test_pages_of_eight_stay_lossless(models, in_process_reference, algorithm):
    """--page-size 8: KV is allocated, and attention reads keys, a page at a time (the target's
    forwards, a draft model's catch-up and chain steps, the EAGLE head's); output stays that of
    one-token pages, and the target as its own draft still has every draft accepted."""
    prompts = mixed_prompts()
    flags = spec_flags(models, "dense", algorithm, draft="dense" if algorithm == "standalone" else None)
    outputs, steps, _ = generate_in_process(flags + ["--page-size", "8"], prompts)
    assert outputs == in_process_reference("dense", prompts)
    if algorithm == "standalone":
        assert steps and all(n == chain for n, chain in steps)


@pytest.mark.parametrize("algorithm", ["eagle", "ngram"])
def test_plain_decodes_under_load_keep_eagle_and_ngram_state(models, in_process_reference, algorithm):
    """Off from 4 decoding requests for drafts that read every token (an EAGLE head's extend,
    n-gram's history): plain decodes seed their per-row state like a one-token prompt chunk, and
    drafting resumes from it losslessly."""
    prompts = mixed_prompts()
    params = [SamplingParams(max_new_tokens=3 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    flags = spec_flags(models, "dense", algorithm) + ["--speculative-disable-by-batch-size", "4"]
    kinds: list[str] = []
    outputs, steps, _ = generate_in_process(flags, prompts, params=params, kinds=kinds)
    reference = in_process_reference("dense", prompts)
    assert outputs == [ref[:p.max_new_tokens] for ref, p in zip(reference, params)]
    assert kinds.index("draft") > kinds.index("plain")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_load_arriving_while_drafting_switches_to_plain_decodes(models, in_process_reference, overlap):
    """Two rows, off from 2 decoding requests: with overlap, a request decoding alone drafts; when the
    next one joins (after its prompt's batch, by which time the drafting step is processed), both
    decode as without speculation, in batches with the next prompts. Target as draft: every draft
    accepted (the draft catches up on the plain decodes it skipped), output lossless."""
    prompts = mixed_prompts()
    params = [SamplingParams(max_new_tokens=4 + 5 * (i % 3), temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    flags = spec_flags(models, "dense", "standalone", draft="dense") + [
        "--speculative-disable-by-batch-size", "2", "--max-running-requests", "2"]
    kinds: list[str] = []
    outputs, steps, _ = generate_in_process(flags, prompts, overlap, params=params, kinds=kinds)
    reference = in_process_reference("dense", prompts)
    assert outputs == [ref[:p.max_new_tokens] for ref, p in zip(reference, params)]
    assert all(n == chain for n, chain in steps)
    assert "plain" in kinds
    if overlap:   # (without overlap the next request is admitted as soon as one finishes: none decodes alone)
        assert any(a == "draft" and b == "plain" for a, b in zip(kinds, kinds[1:]))  # load arrived after drafting


def test_ngram_accepts_drafts_on_repetitive_text(models, in_process_reference):
    prompts = [[11, 12, 13, 14, 15] * 7, [40, 41, 42] * 10 + [40], [7, 8] * 12]
    outputs, steps, _ = generate_in_process(spec_flags(models, "dense", "ngram"), prompts)
    accepted = full_chains(steps)
    assert outputs == in_process_reference("dense", prompts)
    assert sum(accepted) / len(accepted) > 0.5          # > 1.5 tokens per verify step


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_ngram_verifies_only_the_drafts_worth_checking(models, in_process_reference, sampling):
    """On the CPU a greedy step verifies, of its k = 6 drafts, as many as its best row is worth:
    none without a match, SINGLE_TOKEN_MATCH_DRAFTS after a 1-token match, k after a longer one;
    the output stays that of no speculation. A step with sampling rows verifies all k."""
    prompts = [list(range(100, 160))]                       # no token recurs in the prompt
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, ignore_eos=True) if sampling else GREEDY]
    widths: list[tuple[int, int]] = []
    flags = spec_flags(models, "dense", "ngram") + ["--speculative-num-steps", "6"]
    outputs, steps, _ = generate_in_process(flags, prompts, params=params, widths=widths)
    full = [w for chain, w in widths if chain == 6]
    if sampling:
        assert set(full) == {6}
        return
    assert outputs == in_process_reference("dense", prompts)
    assert set(full) <= {0, SINGLE_TOKEN_MATCH_DRAFTS, 6} and 0 in full and len(set(full)) > 1
    assert all(n <= w for (n, _), (_, w) in zip(steps, widths))


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_eagle_chain_ends_before_the_first_unconfident_draft(algorithm, sampling):
    """The embedded target and heads, k = 5, two requests: on the CPU a greedy row verifies its
    drafts up to the first one its head gives probability under DRAFT_CONFIDENCE, the chain stops
    where no row goes on, and the output stays that of no speculation. Sampling rows verify all k."""
    from transformers import AutoTokenizer
    from tests.e2e_prompts import CODE_PROMPTS
    repo = Path(__file__).resolve().parent.parent
    target = repo / "models" / "tandem-dense"
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.encode(CODE_PROMPTS[2]), tok.encode(CODE_PROMPTS[0])]
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, ignore_eos=True) if sampling
              else SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)] * 2
    flags = ["--model-path", str(target), "--speculative-algorithm", algorithm, "--speculative-num-steps", "5",
             "--speculative-draft-model-path", str(repo / "models" / f"tandem-dense-{algorithm}")]
    widths: list[tuple[int, int]] = []
    verified: list[tuple[int, int]] = []
    outputs, _, _ = generate_in_process(flags, prompts, params=params, widths=widths, verified_tokens=verified)
    if sampling:
        assert all(tokens == rows * 6 for rows, tokens in verified)
        return
    reference = generate_in_process(["--model-path", str(target), "--speculative-algorithm", "none"], prompts,
                                    params=params)[0]
    assert outputs == reference
    assert {w for _, w in widths} >= {5} and min(w for _, w in widths) < 5
    assert all(tokens <= rows * (w + 1) for (_, w), (rows, tokens) in zip(widths, verified))
    assert any(rows == 2 and tokens < 2 * (w + 1) for (_, w), (rows, tokens) in zip(widths, verified))


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_eagle_with_a_token_map_drafts_only_mapped_tokens(monkeypatch, tmp_path, sampling):
    """The embedded EAGLE head with a token map of every other token id (half of what the target
    says is out of reach): every draft, greedy or sampled, is a mapped token, the draft
    distribution lives on them, and greedy output stays that of no speculation."""
    from transformers import AutoTokenizer
    from spec.eagle_worker import EagleWorker
    from tests.e2e_prompts import CODE_PROMPTS
    repo = Path(__file__).resolve().parent.parent
    target = repo / "models" / "tandem-dense"
    torch.save(torch.arange(0, 4096, 2), tmp_path / "map.pt")
    hot = set(range(0, 4096, 2))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.encode(CODE_PROMPTS[1]), tok.encode(CODE_PROMPTS[3])]
    params = [SamplingParams(max_new_tokens=32, temperature=1.0, seed=3, ignore_eos=True) if sampling
              else SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)] * 2
    drafted: list[int] = []
    propose = EagleWorker.propose

    def recorded(self, hidden, sb, salt):
        token, q, confidence = propose(self, hidden, sb, salt)
        drafted.extend(token.tolist())
        if q is not None:
            assert float(q.sum(-1).min()) > 0.99 and set(q.nonzero()[:, 1].tolist()) <= hot
        return token, q, confidence
    monkeypatch.setattr(EagleWorker, "propose", recorded)
    flags = ["--model-path", str(target), "--speculative-algorithm", "eagle",
             "--speculative-token-map", str(tmp_path / "map.pt")]
    outputs, _, _ = generate_in_process(flags, prompts, params=params)
    assert len(drafted) > 20 and set(drafted) <= hot
    if not sampling:
        reference = generate_in_process(["--model-path", str(target), "--speculative-algorithm", "none"], prompts,
                                        params=params)[0]
        assert outputs == reference
        assert any(t % 2 for run in reference for t in run)          # the target still emits unmapped tokens


def test_ngram_rows_verify_their_own_widths(models, in_process_reference):
    """Two greedy rows in one batch: one repeats its prompt's pattern (a long match: k drafts),
    the other has no token that recurs (no match at first: none). The verify forward reads each
    row's own width + 1 tokens, not 2 * (k+1), and the output stays that of no speculation."""
    prompts = [[11, 12, 13, 14, 15] * 7, list(range(100, 160))]
    widths: list[tuple[int, int]] = []
    verified: list[tuple[int, int]] = []
    flags = spec_flags(models, "dense", "ngram") + ["--speculative-num-steps", "6"]
    outputs, _, _ = generate_in_process(flags, prompts, widths=widths, verified_tokens=verified)
    assert outputs == in_process_reference("dense", prompts)
    assert len(verified) == len(widths)
    assert all(tokens <= rows * (w + 1) for (_, w), (rows, tokens) in zip(widths, verified))
    assert any(rows == 2 and tokens < 2 * (w + 1) for (_, w), (rows, tokens) in zip(widths, verified))


def test_noisy_standalone_draft_accepts_part_of_the_time(models, in_process_reference):
    prompts = mixed_prompts()
    outputs, steps, _ = generate_in_process(spec_flags(models, "dense", "standalone"), prompts)
    accepted = full_chains(steps)
    assert outputs == in_process_reference("dense", prompts)
    assert 0 < sum(accepted) < K * len(accepted)
    assert set(accepted) == set(range(K + 1))           # rejections at every depth, and full acceptance


@pytest.mark.parametrize("algorithm", ["standalone", "ngram"])
def test_retraction_and_recompute_stay_lossless(models, in_process_reference, algorithm):
    """A KV cache too small for every request: the newest are retracted and re-prefilled
    (prompt + outputs so far), which must reseed the worker's per-row state."""
    prompts = mixed_prompts(seed=3)
    flags = spec_flags(models, "dense", algorithm) + ["--max-total-tokens", "320"]
    outputs, _, retractions = generate_in_process(flags, prompts)
    assert retractions > 0
    assert outputs == in_process_reference("dense", prompts)


@pytest.mark.parametrize("off_at", [0, 4], ids=["always-draft", "plain-under-load"])
@pytest.mark.parametrize("algorithm", ["standalone", "ngram"])
def test_sampling_rows_do_not_disturb_greedy_rows(models, in_process_reference, algorithm, off_at):
    prompts = mixed_prompts()
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, ignore_eos=True)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    flags = spec_flags(models, "dense", algorithm) + ["--speculative-disable-by-batch-size", str(off_at)]
    kinds: list[str] = []
    outputs, steps, _ = generate_in_process(flags, prompts, params=params, kinds=kinds)
    accepted = [n for n, _ in steps]
    reference = in_process_reference("dense", prompts)
    assert [outputs[i] for i in range(0, 8, 2)] == [reference[i] for i in range(0, 8, 2)]
    assert all(len(o) == NEW_TOKENS and all(0 <= t < 512 for t in o) for o in outputs)
    assert max(accepted, default=0) <= K
    if off_at:                                     # 8 rows decode together: under load throughout
        assert set(kinds) == {"plain"}
    else:
        assert "draft" in kinds and "plain" not in kinds


def test_draft_with_another_vocabulary_is_refused(models):
    args = parse_args(BASE_FLAGS + spec_flags(models, "dense", "standalone", draft="small-vocab"))
    device = CpuDevice()
    try:
        with pytest.raises(ValueError, match="vocab_size 256.*has 512"):
            ModelRunner(args, device, 18)
    finally:
        device.close()


# ---- end to end through rank processes -----------------------------------------------

async def generate_with_ranks(flags: list[str], prompts: list[list[int]]):
    async with engine(BASE_FLAGS + flags) as client:
        return await run_batch(client, prompts, GREEDY, timeout=120)


@pytest.fixture(scope="module")
def rank_reference(models):
    prompts = mixed_prompts()
    return {arch: [tokens for tokens, _ in asyncio.run(generate_with_ranks(
                ["--model-path", str(models[arch]), "--speculative-algorithm", "none"], prompts))]
            for arch in ("dense", "moe")}


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("algorithm", ["standalone", "ngram"])
@pytest.mark.parametrize("arch", ["dense", "moe"])
async def test_greedy_is_lossless_through_rank_processes(models, rank_reference, arch, algorithm, overlap):
    flags = spec_flags(models, arch, algorithm) + ([] if overlap else ["--disable-overlap-schedule"])
    results = await generate_with_ranks(flags, mixed_prompts())
    assert [tokens for tokens, _ in results] == rank_reference[arch]
    verify_steps = sum(last.spec_verify_ct for _, last in results)
    assert 0 < verify_steps < len(results) * NEW_TOKENS         # speculated, and accepted some drafts


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_the_log_says_when_eagle_chains_run_in_one_native_call(models, kernels, caplog):
    """LlamaForCausalLMEagle.draft_chain and extend_native where the kernels run the whole head; the
    modules from Python without them."""
    from devices import cpu_native
    args = parse_args(BASE_FLAGS + spec_flags(models, "dense", "eagle") + ["--cpu-kernels", kernels])
    device = CpuDevice()
    try:
        with caplog.at_level(logging.INFO, logger="engine.model_runner"):
            ModelRunner(args, device, 18)
    finally:
        device.close()
    native = kernels == "auto" and cpu_native.cpu_kernels("auto") is not None
    assert "speculation: eagle" in caplog.text
    assert ("greedy chains and extends in one native call each" in caplog.text) == native
