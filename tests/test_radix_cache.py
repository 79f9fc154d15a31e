"""The radix prefix cache (engine/radix_cache.py) on plain data.

- The tree: longest match in whole pages, reference counts that keep pages, LRU eviction of
  unreferenced leaves (parents after their children), duplicates handed back, flush refused in use.
- The scheduler over a device that keeps K/V content: each slot holds a hash of the tokens up to its
  position, computed from the slot before it as the table maps them, and a sampled token comes from
  the last slot's hash. A page shared for the wrong tokens, a cached page rewritten, or a position
  read before it was written changes the outputs, which are checked against the same hash chain
  computed without any cache. After every step the pool's pages are checked: each in exactly one
  place (free, one request's own, the cache), and every cached page a request reads holds its tokens.
"""
from __future__ import annotations

import copy
import random

import pytest

import tests.test_scheduler as plain
from engine.batch import StepOutput
from engine.kv_pool import KVPool
from engine.messages import SamplingParams
from engine.radix_cache import ROOT, RadixCache
from engine.request import Status
from engine.scheduler import Scheduler, SchedulerConfig
from spec.policy import SpeculativeDecoding
from tests.pool_checks import check_pool
from tests.test_spec_gate import Scripted

# ---- the tree -------------------------------------------------------------------------------


def test_match_is_the_longest_cached_prefix_in_whole_pages():
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == []
    assert cache.pages_of(cache.match([1, 2, 3, 4, 9, 9], 6)) == [10, 11]
    assert cache.pages_of(cache.match([1, 2, 3, 4, 5, 6], 5)) == [10, 11]      # the limit cuts a page
    assert cache.pages_of(cache.match([1, 2, 3], 3)) == [10]                   # a partial page never matches
    assert cache.match([2, 2], 2) == [] and (cache.pages, cache.evictable) == (3, 3)
    assert cache.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == [20, 21]        # [1, 2, 3, 4] held already
    assert cache.insert([1, 2, 3, 4], [10, 11]) == []                        # its own pages: nothing spare
    assert cache.pages == 4


def test_referenced_pages_stay_and_the_least_recently_used_leaves_go_first():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 5], [0, 3])
    cache.insert([7], [4])
    held = cache.match([1, 2, 3], 3)
    cache.lock(held)
    assert cache.evictable == 2                      # [1, 5]'s leaf and [7]
    cache.match([7], 1)                              # [7] used last
    assert cache.evict(1) == [3] and cache.evict(5) == [4]
    assert cache.pages == 3 and cache.evictable == 0
    with pytest.raises(RuntimeError):
        cache.flush()
    cache.unlock(held)
    assert cache.evict(2) == [2, 1]                  # a leaf, then its parent once it is a leaf
    assert sorted(cache.flush()) == [0] and cache.pages == 0


def lru_walk(cache: RadixCache, wanted: int) -> list[int]:
    """The reference eviction, on a copy: walk the whole tree for its leaves with ref 0, take the least
    recently used one, and again (a parent once its last child went), `wanted` times at most."""
    cache = copy.deepcopy(cache)
    freed = []
    while len(freed) < wanted:
        leaves = [n for n in cache.nodes() if cache.kids[n] == 0 and cache.ref[n] == 0]
        if not leaves:
            break
        freed.append(cache.remove(min(leaves, key=lambda n: (cache.last_use[n], n))))
    return freed


@pytest.mark.parametrize("page_size, lookahead", [(1, 0), (2, 1)])
def test_eviction_takes_the_least_recently_used_leaves_without_walking_the_tree(page_size, lookahead, monkeypatch):
    """Requests over shared prefixes come and go (match, lock, insert, unlock; matches that lock nothing)
    and the pool asks for pages now and then: each eviction frees what walking the whole tree for the
    least recently used leaf, again and again, would free. With a page a token a full pool's tree has a
    node a slot, so eviction must not walk it: `nodes` is forbidden while it runs."""
    rng, cache, next_page, held, done = random.Random(page_size), RadixCache(page_size, lookahead), 0, [], []
    stems = [[rng.randrange(3) for _ in range(12)] for _ in range(4)]
    walk = RadixCache.nodes
    for _ in range(600):
        action = rng.random()
        if action < 0.1 and done:  # a match that locks nothing: an admission that did not fit (plan_prefill)
            tokens = rng.choice(done)
            cache.match(tokens, len(tokens))
        elif action < 0.45 or not held:
            tokens = rng.choice(stems)[:rng.randrange(12)] + [rng.randrange(3) for _ in range(rng.randrange(8))]
            path = cache.match(tokens, len(tokens))
            cache.lock(path)
            held.append((tokens, path))
        elif action < 0.85:
            tokens, path = held.pop(rng.randrange(len(held)))
            pages = cache.pages_of(path)
            while len(pages) * page_size < len(tokens):
                pages.append(next_page := next_page + 1)
            cache.insert(tokens, pages)
            cache.unlock(path)
            done.append(tokens)
        else:
            wanted = rng.randrange(1, 6)
            expected = lru_walk(cache, wanted)
            monkeypatch.setattr(RadixCache, "nodes", lambda self: pytest.fail("eviction walked the tree"))
            assert cache.evict(wanted) == expected
            monkeypatch.setattr(RadixCache, "nodes", walk)
        evictable = [n for n in cache.nodes() if cache.ref[n] == 0]
        assert cache.evictable == len(evictable) and cache.pages == sum(1 for _ in cache.nodes())
        assert len(cache.leaves) <= 4 * max(cache.evictable, 64) + 1
    assert cache.stats.evicted_pages > 50


def tree_of(cache: RadixCache) -> set:
    """Every node as (the keys from the root to it, its page, its ref)."""
    def keys(node):
        return () if node == ROOT else keys(cache.parent[node]) + (cache.key[node],)
    return {(keys(n), cache.page[n], cache.ref[n]) for n in cache.nodes()}


@pytest.mark.parametrize("page_size, lookahead", [(1, 0), (2, 1)])
def test_inserting_below_the_held_path_builds_the_tree_a_walk_from_the_root_builds(page_size, lookahead):
    """A finished request inserts from the end of the path it matched (Scheduler.release_pages): twin
    caches, one inserting that way and one from the root, go through the same requests and evictions and
    hold the same tree, hand back the same pages and evict the same ones."""
    rng, next_page, held = random.Random(7 + page_size), 0, []
    below, rooted = RadixCache(page_size, lookahead), RadixCache(page_size, lookahead)
    stems = [[rng.randrange(3) for _ in range(10)] for _ in range(3)]
    for _ in range(400):
        action = rng.random()
        if action < 0.45 or not held:
            tokens = rng.choice(stems)[:rng.randrange(10)] + [rng.randrange(3) for _ in range(rng.randrange(8))]
            paths = below.match(tokens, len(tokens)), rooted.match(tokens, len(tokens))
            below.lock(paths[0])
            rooted.lock(paths[1])
            held.append((tokens, paths))
        elif action < 0.9:
            tokens, (path, twin) = held.pop(rng.randrange(len(held)))
            pages = below.pages_of(path)
            while len(pages) * page_size < len(tokens):
                pages.append(next_page := next_page + 1)
            assert below.insert(tokens, pages, after=path) == rooted.insert(tokens, pages)
            below.unlock(path)
            rooted.unlock(twin)
        else:
            wanted = rng.randrange(1, 5)
            assert below.evict(wanted) == rooted.evict(wanted)
        assert tree_of(below) == tree_of(rooted)
        assert (below.pages, below.evictable) == (rooted.pages, rooted.evictable)


def test_with_a_lookahead_a_page_matches_only_where_the_token_after_it_is_the_same_too():
    """A draft that reads token t+1 at position t (an EAGLE head) left K/V in a page for the token after it."""
    cache = RadixCache(page_size=2, lookahead=1)
    assert cache.insert([1, 2, 3, 4, 5], [10, 11]) == []                     # [1, 2] before 3, [3, 4] before 5
    assert cache.pages_of(cache.match([1, 2, 3, 4, 5, 6], 5)) == [10, 11]
    assert cache.pages_of(cache.match([1, 2, 3, 4, 9], 4)) == [10]         # [3, 4] was cached before 5, not 9
    assert cache.insert([1, 2, 3, 4, 9], [10, 20]) == []                     # so [3, 4] before 9 is a page of its own
    assert cache.pages_of(cache.match([1, 2, 3, 4, 9], 4)) == [10, 20] and cache.pages == 3
    assert cache.insert([1, 2, 3], [30]) == [30]                              # held already
    assert cache.insert([7, 8], [40]) == [40] and cache.pages == 3           # no token after it: it cannot be keyed


# ---- the scheduler over a device with K/V content ------------------------------------------------

MASK = (1 << 61) - 1


def chain(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token + 1) & MASK


def sample(state: int) -> int:
    return state % 47 + 1                       # never 49 (eos), never 0


def reference(prompt: list[int], n: int) -> list[int]:
    state, out = 0, []
    for token in prompt:
        state = chain(state, token)
    for _ in range(n):
        out.append(sample(state))
        state = chain(state, out[-1])
    return out


class KvDevice:
    """Keeps each slot's content; a sequence reads its positions' slots through the table."""

    def __init__(self):
        self.futures, self.table, self.kv = {}, {}, {}

    def run(self, batch) -> StepOutput:
        for row, pos, slot in zip(batch.table_rows, batch.table_pos, batch.table_slots):
            self.table[row, pos] = slot
        runs, offset = [], 0
        for seq in batch.seqs:
            fed = [self.futures[-t] if t < 0 else t for t in batch.input_ids[offset:offset + seq.q_len]]
            offset += seq.q_len
            state = self.kv[self.table[seq.row, seq.start - 1]] if seq.start else 0
            for i, token in enumerate(fed):
                state = chain(state, token)
                self.kv[self.table[seq.row, seq.start + i]] = state
            if seq.samples:
                runs.append([sample(state)])
                self.futures[seq.future_id] = runs[-1][0]
        return StepOutput(tokens=runs)


def make(num_slots: int, page_size: int, policy=None, rows: int = 8) -> Scheduler:
    config = SchedulerConfig(max_running_requests=rows, max_queued_requests=400, max_prefill_tokens=64,
                             chunked_prefill_size=24, context_length=4096, future_slots=2 * rows + 2)
    return Scheduler(config, KVPool(num_slots, page_size, rows, cache=True), eos_ids=frozenset({49}),
                     policy=policy)


def drive_kv(sched: Scheduler, overlap: bool, arrivals: dict[int, list]) -> dict:
    device, requests = KvDevice(), {}

    def arrive(step: int) -> None:
        for rid, prompt, n in arrivals.pop(step, []):
            assert sched.add(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)) is None
            requests[rid] = (sched.requests[rid], prompt)

    def on_step(s: Scheduler) -> None:
        check_pool(s)
        arrive(s.step)
    original, plain.FakeDevice = plain.FakeDevice, lambda: device
    try:
        while arrivals:
            arrive(min(arrivals))
            plain.drive(sched, overlap, max_steps=20000, on_step=on_step)
    finally:
        plain.FakeDevice = original
    return requests


def shared_prefix_traffic(seed: int, count: int) -> dict[int, list]:
    """Groups of prompts over a few system prompts, some sent again whole, some extending an earlier
    prompt and its answer (a chat's next turn), arriving over time."""
    rng, arrivals, sent = random.Random(seed), {}, []
    systems = [[rng.randrange(1, 40) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    for i in range(count):
        kind = rng.random()
        if sent and kind < 0.2:
            prompt = list(rng.choice(sent))                                  # the same prompt again
        elif sent and kind < 0.4:
            earlier = rng.choice(sent)
            prompt = earlier + reference(earlier, 6) + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 30))]
        sent.append(prompt)
        arrivals.setdefault(rng.randrange(0, count * 2), []).append((f"r{i}", prompt, rng.randrange(1, 12)))
    return arrivals


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_are_those_computed_without_a_cache_and_pages_are_reused(overlap, page_size):
    sched = make(num_slots=4096, page_size=page_size)
    requests = drive_kv(sched, overlap, shared_prefix_traffic(page_size, 60))
    for req, prompt in requests.values():
        assert req.output_ids == reference(prompt, req.params.max_new_tokens), req.rid
    stats = sched.pool.cache.stats
    assert stats.hit_tokens > stats.prompt_tokens // 4
    assert any(req.cached_tokens for req, _ in requests.values())
    assert sched.pool.used_slots == 0 and sched.pool.free_count == sched.pool.num_pages


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_small_pool_evicts_and_retracts_and_stays_exact(overlap):
    """A KV budget of a few prompts' worth and many distinct prefixes: evictions, retractions that
    keep what they can, never a page in two places, and the whole pool free again after a flush."""
    sched = make(num_slots=160, page_size=2)
    requests = drive_kv(sched, overlap, shared_prefix_traffic(7, 120))
    for req, prompt in requests.values():
        assert req.output_ids == reference(prompt, req.params.max_new_tokens), req.rid
    cache = sched.pool.cache
    assert cache.stats.evicted_pages > 0 and cache.stats.hit_tokens > 0
    assert sched.pool.used_slots == 0
    sched.pool.free_pages.extend(cache.flush())
    assert len(sched.pool.free_pages) == sched.pool.num_pages


def test_a_failed_step_leaves_nothing_in_the_cache_and_unlocks_what_it_read():
    sched = make(num_slots=512, page_size=1)
    device = KvDevice()
    sched.add("a", list(range(1, 30)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    while sched.has_work:
        batch = sched.schedule()
        sched.process(batch, device.run(batch))
    assert sched.pool.cache.pages == 31                      # prompt and outputs, all but the last (never fed)
    sched.add("b", list(range(1, 30)) + [7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True))
    batch = sched.schedule()
    req = sched.requests["b"]
    assert req.cached_tokens == 29 and batch.seqs[0].start == 29 and batch.seqs[0].q_len == 2
    assert sched.pool.cache.evictable == 2                  # the first answer's, which "b" does not read
    sched.fail(req, "step failed")
    check_pool_after(sched)
    assert sched.pool.cache.pages == 31 and sched.pool.cache.evictable == 31


def check_pool_after(sched: Scheduler) -> None:
    assert not sched.running and sched.pool.used_slots == 0
    assert len(sched.pool.free_pages) + sched.pool.cache.pages == sched.pool.num_pages


def test_an_abort_in_flight_caches_only_what_processed_steps_wrote():
    sched = make(num_slots=512, page_size=1)
    device = KvDevice()
    prompt = list(range(1, 60))
    sched.add("a", prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    first = sched.schedule()                                  # 24 tokens
    second = sched.schedule()                                 # the next 24, in flight with the first
    sched.process(first, device.run(first))
    assert sched.requests["a"].written == 24
    sched.abort("a", "abort")
    assert sched.pool.cache.pages == 24 and sched.requests.get("a") is None
    sched.process(second, device.run(second))
    sched.add("b", prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    while sched.has_work:
        batch = sched.schedule()
        sched.process(batch, device.run(batch))
    assert sched.requests.get("b") is None
    check_pool_after(sched)


def test_a_speculative_draft_starts_where_the_cache_ends():
    policy = SpeculativeDecoding(spec_tokens=4, draft_catches_up=True)
    sched = make(num_slots=512, page_size=1, policy=policy)
    sched.pool.cache.insert(list(range(1, 30)), sched.pool.free_pages[-29:][::-1])
    del sched.pool.free_pages[-29:]
    sched.add("a", list(range(1, 40)), SamplingParams(max_new_tokens=5, ignore_eos=True))
    batch = sched.schedule()
    req = sched.requests["a"]
    assert batch.seqs[0].start == 29 and req.decode.draft_end == 39 and not batch.spec.draft_skip
    assert req.status is Status.RUNNING and req.decode.draft_lag == 0 and req.cached_tokens == 29


@pytest.mark.parametrize("speculative", [False, True])
def test_pages_whose_draft_state_is_stale_stay_out_of_the_cache(speculative):
    """A request that ends with its first token: its draft never reads the prompt (spec/policy.py's
    no_decode), so with a draft its pages would carry stale draft K/V, and a seeded request reading them
    would draw other tokens than it would alone: they are not cached. Without a draft they are."""
    policy = SpeculativeDecoding(spec_tokens=4) if speculative else None
    sched = make(num_slots=512, page_size=1, policy=policy)
    device = KvDevice()
    sched.add("one", list(range(1, 30)), SamplingParams(max_new_tokens=1, ignore_eos=True))
    while sched.has_work:
        batch = sched.schedule()
        sched.process(batch, device.run(batch))
    assert sched.pool.cache.pages == (0 if speculative else 29)
    assert sched.pool.used_slots == 0 and sched.pool.free_count == sched.pool.num_pages


def test_positions_an_eagle_head_stepped_aside_from_stay_out_of_the_cache():
    """Once the gate settles on plain decoding, an EAGLE head skips the plain runs (spec/policy.py: aside),
    and the prompts that join them: a seeded request that read those pages would draft from K/V the head
    never wrote, so only what it read before is cached, and a prompt it never read adds nothing."""
    gate = Scripted([False], settle_after=1)
    sched = make(num_slots=512, page_size=1,
                 policy=SpeculativeDecoding(spec_tokens=4, rounds=4, gate=gate, draft_falls_behind=True))
    sched.add("g", [1, 2, 3], SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True))
    runs = [[4], [5, 6, 7, 8], [9, 10, 11, 12]]       # the prompt, a plain run the head reads, one it skips
    for tokens in runs:
        batch = sched.schedule()
        sched.process(batch, StepOutput(tokens=[tokens]))
    assert batch.spec.draft_skip and not sched.requests
    assert sched.pool.cache.pages == 7                # positions 0-6: the prompt and the run the head read

    short = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    sched.add("h", [1, 2, 3, 4, 5, 6, 7, 8, 20], short)
    sched.add("i", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 30], short)
    batch = sched.schedule()                          # settled: greedy prompts go unread
    assert batch.spec.draft_skip and [s.req.cached_tokens for s in batch.seqs] == [7, 7]
    sched.process(batch, StepOutput(tokens=[[21], [31]]))
    while sched.has_work:
        batch = sched.schedule()
        sched.process(batch, StepOutput(tokens=[[40] for _ in batch.sampling]))
    assert sched.pool.cache.pages == 7
