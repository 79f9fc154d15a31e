"""The KV pool's and the prefix cache's invariants (engine/kv_pool.py, engine/radix_cache.py), checked
after every step by the scheduler's tests on plain data and by the engine's on the embedded model."""
from __future__ import annotations

from collections import Counter

from engine.radix_cache import ROOT
from engine.scheduler import Scheduler


def check_pool(sched: Scheduler) -> None:
    """Every page in exactly one place (the free list, a request's own pages, the cache); every cached page
    a request reads is on its path in the tree, holds its tokens and counts it among its references."""
    pool, cache = sched.pool, sched.pool.cache
    nodes = list(cache.nodes())
    places = list(pool.free_pages) + cache.pages_of(nodes)
    readers: Counter = Counter()
    for req in [*sched.running, *sched.reserved.values()]:
        places += req.pages[len(req.cache_path):]
        parent = ROOT
        for i, node in enumerate(req.cache_path):
            start = i * pool.page_size
            assert cache.parent[node] == parent and req.pages[i] == cache.page[node], \
                f"{req.rid} reads page {i} off its path"
            assert list(cache.key[node]) == req.all_ids[start:start + pool.page_size + cache.lookahead], \
                f"{req.rid} reads a page cached for other tokens"
            readers[node] += 1
            parent = node
    assert sorted(places) == list(range(pool.num_pages)), "a page lost, or in two places"
    assert all(cache.ref[node] == readers[node] for node in nodes), "a reference count is not its readers'"
    assert cache.pages == len(nodes) and cache.evictable == sum(cache.ref[node] == 0 for node in nodes)
