"""KV page allocator and request rows: pure Python, no tensors.

The device side (per-layer K/V tensors and the request->slot table) lives in the
model runner; this class only hands out page and row numbers. Slot of position p
in a request = pages[p // page_size] * page_size + p % page_size.

Every page is in exactly one place: the free list, a request's `pages` (its own), or the
radix cache (engine/radix_cache.py; a request that matched a prefix lists the cache's pages
first in its `pages` but does not own them). Pages the cache holds and no running request
reads count as free: `grow` takes them back when the free list runs short.
"""
from __future__ import annotations

from engine.radix_cache import RadixCache
from engine.stats import Stat, gauge

EVICT_AT_LEAST = 32      # pages the cache gives back when the free list runs short (fewer if it has fewer)


class KVPool:
    def __init__(self, num_slots: int, page_size: int, num_rows: int, cache: bool = False, cache_lookahead: int = 0):
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.cache = RadixCache(page_size, cache_lookahead) if cache else None

    @property
    def free_count(self) -> int:
        """Pages a request can get now: free ones, and those the cache would give back."""
        return len(self.free_pages) + (self.cache.evictable if self.cache else 0)

    @property
    def cached_slots(self) -> int:
        return self.cache.pages * self.page_size if self.cache else 0

    @property
    def total_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def used_slots(self) -> int:
        """Slots that running requests hold (their own pages and the cached ones they read)."""
        unread = self.cache.evictable if self.cache else 0
        return (self.num_pages - len(self.free_pages) - unread) * self.page_size

    def stats(self) -> list[Stat]:
        """Used + free + the prefix cache's idle tokens = total."""
        return [gauge("tandem_kv_slots_used", "KV cache slots in use.", self.used_slots),
                gauge("tandem_kv_slots_total", "KV cache slots in all.", self.total_slots),
                gauge("tandem_kv_slots_free", "KV cache slots on the free list.",
                      len(self.free_pages) * self.page_size),
                *(self.cache or RadixCache(self.page_size)).table()]

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_grow(self, pages: list[int], new_len: int) -> bool:
        return self.pages_for(new_len) - len(pages) <= self.free_count

    def grow(self, pages: list[int], new_len: int) -> bool:
        """Extend `pages` in place to hold new_len positions; False (and no change) if full."""
        need = self.pages_for(new_len) - len(pages)
        if need > self.free_count:
            return False
        if need > len(self.free_pages):          # a batch at a time
            self.free_pages.extend(self.cache.evict(max(need - len(self.free_pages), EVICT_AT_LEAST)))
        for _ in range(max(need, 0)):
            pages.append(self.free_pages.pop())
        return True

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))
        pages.clear()

    def release_tail(self, pages: list[int], keep: int) -> None:
        """Return pages[keep:] to the pool."""
        tail = pages[keep:]
        del pages[keep:]
        self.free_pages.extend(reversed(tail))

    def take_row(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def give_row(self, row: int) -> None:
        self.free_rows.append(row)

    def slots(self, pages: list[int], start: int, end: int) -> list[int]:
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]
