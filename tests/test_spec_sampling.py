"""Speculative sampling leaves the target distribution unchanged: rejection sampling
checked exactly on large synthetic batches, then end to end (temperature 1 and top-p)
against sampling without speculation on a model small enough to enumerate."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from engine.messages import SamplingParams
from spec.verify import verify_sampled
from tests.checkpoints import random_head, random_target
from tests.engine_harness import engine, run_batch

P_MIN = 1e-3          # reject "same distribution" only below this p-value


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * observed.sum()
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat.double() / 2.0))


def two_sample_p(a: Counter, b: Counter) -> float:
    keys = sorted(set(a) | set(b))
    x = torch.tensor([a[k] for k in keys], dtype=torch.float64)
    y = torch.tensor([b[k] for k in keys], dtype=torch.float64)
    ka, kb = (y.sum() / x.sum()).sqrt(), (x.sum() / y.sum()).sqrt()
    stat = ((ka * x - kb * y) ** 2 / (x + y)).sum()
    return float(torch.special.gammaincc(torch.tensor((len(keys) - 1) / 2.0), stat / 2.0))


def test_rejection_sampling_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 200_000, 3, 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)       # target, one row per position
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)           # draft
    drafts = torch.stack([torch.multinomial(q[i], batch, replacement=True, generator=g) for i in range(k)], 1)
    uniform = torch.rand(batch, k, generator=g)
    exponential = torch.empty(batch, vocab).exponential_(generator=g)
    emitted, n = verify_sampled(drafts, q.expand(batch, k, vocab), p.expand(batch, k + 1, vocab),
                                uniform, exponential)
    # First emitted token ~ p0, whatever was drafted.
    assert chi_square_p(torch.bincount(emitted[:, 0], minlength=vocab).double(), p[0].double()) > P_MIN
    # Acceptance of the first draft happens with probability sum(min(p0, q1)).
    expected_accept = torch.minimum(p[0], q[0]).sum()
    assert abs((n >= 1).double().mean() - expected_accept) < 0.01
    # Given the first draft was accepted, the second emitted token ~ p1 (positions are independent here).
    second = emitted[n >= 1, 1]
    assert chi_square_p(torch.bincount(second, minlength=vocab).double(), p[1].double()) > P_MIN
    # The emitted run has n+1 tokens and never more than k+1.
    assert int(n.max()) <= k


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny_vocab")
    target = random_target(base / "target", vocab=24, hidden=32, layers=2)
    return target, random_head(base / "head", target)


async def sample_tokens(flags, count: int, params: SamplingParams, prompt=(3, 5, 7)) -> list[list[int]]:
    async with engine(flags + ["--max-running-requests", "64", "--max-queued-requests", "4096"]) as client:
        plist = [SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "seed": i})
                 for i in range(count)]
        results = await run_batch(client, [list(prompt)] * count, plist, timeout=600)
    return [tokens for tokens, _ in results]


@pytest.mark.slow
@pytest.mark.parametrize("top_p, token_map", [(1.0, False), (0.8, False), (1.0, True)],
                         ids=["temperature-1", "top-p", "token-map"])
def test_speculative_sampling_matches_plain_sampling(tiny_models, tmp_path, top_p, token_map):
    """token-map: the head drafts from half the vocabulary (q is 0 elsewhere); rejection sampling
    must still give the target's distribution, tokens outside the map included."""
    target, head = tiny_models
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=top_p, ignore_eos=True)
    base = ["--model-path", str(target)]
    spec = base + ["--speculative-algorithm", "eagle", "--speculative-draft-model-path", str(head)]
    if token_map:
        torch.save(torch.arange(0, 24, 2), tmp_path / "map.pt")
        spec += ["--speculative-token-map", str(tmp_path / "map.pt")]
    count = 1200
    plain = asyncio.run(sample_tokens(base + ["--speculative-algorithm", "none"], count, params))
    specd = asyncio.run(sample_tokens(spec, count, params))
    for position in (1, 2, 3):                  # tokens produced by verify steps
        a = Counter(t[position] for t in plain)
        b = Counter(t[position] for t in specd)
        assert two_sample_p(a, b) > P_MIN, (position, a, b)
    if token_map:                                # the residual still emits what the map leaves out
        assert sum(t % 2 for tokens in specd for t in tokens[1:]) > count // 10
    # The joint of positions 1 and 2 too.
    assert two_sample_p(Counter(tuple(t[1:3]) for t in plain), Counter(tuple(t[1:3]) for t in specd)) > P_MIN


@pytest.mark.slow
def test_seeded_speculative_sampling_is_reproducible(tiny_models):
    target, head = tiny_models
    flags = ["--model-path", str(target), "--speculative-algorithm", "eagle",
             "--speculative-draft-model-path", str(head)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    first = asyncio.run(sample_tokens(flags, 16, params))
    second = asyncio.run(sample_tokens(flags, 16, params))
    assert first == second
    assert len(set(map(tuple, first))) > 1
