"""The radix prefix cache: KV pages of finished (and retracted) requests kept, keyed by their
tokens, so that a request whose prompt starts the same way prefills only the rest. Pure Python:
page numbers and token ids, no tensors (the pages' K/V stay where the pool put them).

A tree of pages: each node holds one full page (page_size positions) and is keyed, under its
parent, by the tokens of that page; the path from the root spells a token prefix, and the K/V in
the path's pages is that prefix's (K/V at a position depends on the tokens up to it, never after,
so a prefix's pages serve every sequence that starts with it). Partial pages are never shared.

With a draft whose K/V at a position depends on the token after it (an EAGLE head reads token t+1
at position t: `lookahead` 1), a page's K/V is its tokens' only when that next token is the same
too, so each node's key holds the page's tokens and the token after them. A request whose prompt
leaves a page with another token than the one cached (a new question after a shared system
prompt) matches one page less and computes that page itself; were it to read the page, its drafts
would differ from those it would make alone, and a seeded request would draw other tokens.

  ref        running requests that read the node's page (each holds its whole matched path): a
             page with ref > 0 is never evicted, and nothing writes a cached page (a request that
             matched m positions writes from position m on, in pages of its own)
  evictable  nodes with ref 0: all of them can go, leaves first (a node with ref 0 has no
             descendant with ref > 0, since a request holds whole paths)

A node is an index into the cache's lists (page, key, parent, ref, last_use, children), and its
children are found in one dict keyed (parent, key): a full pool's tree holds as many nodes as the pool
has slots (with a page a token), and as objects of their own (a node, its dict of children, its heap
entries) they were most of what the garbage collector walked in a full collection of a rank, which then
held its loop 70-170 ms under steady prefix-cache traffic (docs/reliability.md, "Collector pauses").
Lists of ints and tuples of ints are a few objects the collector reads past.

The pool asks the cache for pages when its free list runs short (KVPool.grow -> evict): the least
recently used leaves with ref 0 go first, and their parents may follow. With a page a token, a
full pool's tree holds as many nodes as the pool has slots, and a server under steady load evicts
every few steps: eviction never walks the tree. A heap holds (last_use, node) entries, pushed when
a node is or becomes an evictable leaf with that last_use (insert, match, unlock, a child's
eviction); an entry whose node was used since, locked, given a child or removed is stale and
skipped (a fresher entry exists for whatever can go). Stale entries beyond a few per evictable
page are swept out in one pass, so the heap stays within a constant of the tree.

NOTE: only K/V written by processed steps is inserted (Request.written): with overlap the step in
flight may still write a request's later positions, never those below `written`.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from engine.stats import MEAN_MEASURED, Stat, counter, gauge

STALE_FACTOR = 4     # heap entries per evictable page (at least 64) past which the stale ones are swept out
ROOT = 0             # the root node: no page, no key; a removed node's parent is GONE
GONE = -1


@dataclass
class CacheStats:
    """Counters since start (tokens are positions: page_size tokens a page)."""
    prompt_tokens: int = 0      # prompt tokens of requests admitted (each admission, recomputes included)
    hit_tokens: int = 0         # ... of those, found in the cache
    evicted_pages: int = 0
    inserted_pages: int = 0


class RadixCache:
    def __init__(self, page_size: int, lookahead: int = 0):
        self.page_size = page_size
        self.lookahead = lookahead  # tokens after a page that its K/V depends on (0 or 1)
        # node i: its pool page, its key under its parent (the page's tokens and the lookahead after them),
        # its parent (ROOT's: GONE), the running requests that read it, its last use, its children
        self.page, self.key, self.parent = [-1], [()], [GONE]
        self.ref, self.last_use, self.kids = [0], [0], [0]
        self.child: dict[tuple[int, tuple[int, ...]], int] = {}     # (parent, key) -> node
        self.spare_ids: list[int] = []                                # removed nodes' indices, for reuse
        self.pages = 0              # pages the tree holds
        self.evictable = 0          # ... of those, with ref 0
        self.stats = CacheStats()
        self.clock = itertools.count(1)
        self.leaves: list[tuple[int, int]] = []     # (last_use, node): evictable leaves, and stale entries

    # ---- lookup --------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The longest cached path (its nodes) spelling a prefix of tokens[:limit], in whole pages (each
        followed in `tokens` by its lookahead)."""
        path, node, ps, now, child, last_use = [], ROOT, self.page_size, next(self.clock), self.child, self.last_use
        for start in range(0, limit - limit % ps, ps):
            node = child.get((node, self.key_at(tokens, start)))
            if node is None:
                break
            last_use[node] = now
            path.append(node)
        if path:
            self.offer(path[-1])                 # only the path's end can be a leaf
        return path

    def pages_of(self, path: list[int]) -> list[int]:
        return [self.page[node] for node in path]

    def lock(self, path: list[int]) -> None:
        """A request reads these pages: none of them may go."""
        ref = self.ref
        for node in path:
            self.evictable -= ref[node] == 0
            ref[node] += 1

    def unlock(self, path: list[int]) -> None:
        now, ref = next(self.clock), self.ref
        for node in path:
            ref[node] -= 1
            self.last_use[node] = now
            self.evictable += ref[node] == 0
            self.offer(node)

    # ---- insertion -------------------------------------------------------------------------

    def key_at(self, tokens: list[int], start: int) -> tuple[int, ...] | None:
        """The key of the page at `start`: its tokens and the lookahead (None where tokens end first)."""
        key = tuple(tokens[start:start + self.page_size + self.lookahead])
        return key if len(key) == self.page_size + self.lookahead else None

    def insert(self, tokens: list[int], pages: list[int], after: list[int] | None = None) -> list[int]:
        """Cache the K/V of tokens[:len(pages) * page_size], held in `pages` (`tokens` goes on with the
        lookahead after them). The tree takes the pages it lacked; returns those it already held another
        copy of, or could not key (the caller frees them). A page that is already the tree's (a matched
        prefix) stays where it is. `after`: the path the request matched and still holds (locked, so in
        the tree; its pages head `pages`): the walk starts below it, not at the root, so a long shared
        prefix costs its readers nothing here (unlock stamps the path's last use)."""
        after = after or []
        node, ps, now, spare = (after[-1] if after else ROOT), self.page_size, next(self.clock), []
        for i in range(len(after), len(pages)):
            page = pages[i]
            key = self.key_at(tokens, i * ps)
            if key is None:
                self.offer(node)
                return spare + pages[i:]
            child = self.child.get((node, key))
            if child is None:
                child = self.add(node, key, page, now)
            elif self.page[child] != page:
                spare.append(page)
            self.last_use[child] = now
            node = child
        self.offer(node)
        return spare

    def add(self, parent: int, key: tuple[int, ...], page: int, now: int) -> int:
        if self.spare_ids:
            node = self.spare_ids.pop()
            self.page[node], self.key[node], self.parent[node] = page, key, parent
            self.ref[node], self.last_use[node], self.kids[node] = 0, now, 0
        else:
            node = len(self.page)
            self.page.append(page), self.key.append(key), self.parent.append(parent)
            self.ref.append(0), self.last_use.append(now), self.kids.append(0)
        self.child[parent, key] = node
        self.kids[parent] += 1
        self.pages += 1
        self.evictable += 1
        self.stats.inserted_pages += 1
        return node

    # ---- eviction --------------------------------------------------------------------------

    def offer(self, node: int) -> None:
        """`node` may have just become an evictable leaf, or been used while one: its entry, at its last_use."""
        if node != ROOT and self.ref[node] == 0 and self.kids[node] == 0:
            heapq.heappush(self.leaves, (self.last_use[node], node))
            if len(self.leaves) > STALE_FACTOR * max(self.evictable, 64):
                self.sweep()

    def sweep(self) -> None:
        """Drop the stale entries (one pass over the heap, not the tree)."""
        self.leaves = [entry for entry in self.leaves if self.current(entry)]
        heapq.heapify(self.leaves)

    def current(self, entry: tuple[int, int]) -> bool:
        """Is the entry its node's latest, with the node still in the tree, a leaf and read by no request? (A
        removed node's index is reused only by an insert, which stamps it later than any entry before it.)"""
        last_use, node = entry
        return (self.parent[node] != GONE and self.ref[node] == 0 and self.kids[node] == 0
                and self.last_use[node] == last_use)

    def evict(self, wanted: int) -> list[int]:
        """Free up to `wanted` pages, least recently used leaves with ref 0 first."""
        freed: list[int] = []
        while self.leaves and len(freed) < wanted:
            entry = heapq.heappop(self.leaves)
            if not self.current(entry):
                continue
            parent = self.parent[entry[1]]
            freed.append(self.remove(entry[1]))
            self.offer(parent)                   # a leaf now, where its last child went
        self.stats.evicted_pages += len(freed)
        return freed

    def remove(self, node: int) -> int:
        """Take a leaf out of the tree; returns its page."""
        parent = self.parent[node]
        del self.child[parent, self.key[node]]
        self.kids[parent] -= 1
        self.parent[node], self.key[node] = GONE, ()       # out of the tree: its heap entries are stale
        self.spare_ids.append(node)
        self.pages -= 1
        self.evictable -= 1
        return self.page[node]

    def nodes(self):
        """Every node in the tree (not the root)."""
        return (node for node in range(1, len(self.page)) if self.parent[node] != GONE)

    def table(self) -> list[Stat]:
        """Its metrics (engine/stats.py); a rank without a cache reports an empty one's."""
        stats, ps = self.stats, self.page_size
        rate = stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        return [counter("tandem_prefix_cache_prompt_tokens", "Prompt tokens of requests admitted (recomputes "
                        "included).", stats.prompt_tokens),
                counter("tandem_prefix_cache_hit_tokens", "Of those, tokens read from the prefix cache.",
                        stats.hit_tokens),
                gauge("tandem_prefix_cache_hit_rate", "Share of prompt tokens read from the prefix cache since start "
                      "(mean over the ranks that admitted any).", rate, MEAN_MEASURED),
                gauge("tandem_prefix_cache_tokens", "Tokens the prefix cache holds.", self.pages * ps),
                gauge("tandem_prefix_cache_idle_tokens", "Of those, tokens no running request reads (free to evict).",
                      self.evictable * ps),
                counter("tandem_prefix_cache_evicted_tokens", "Tokens evicted from the prefix cache.",
                        stats.evicted_pages * ps)]

    def flush(self) -> list[int]:
        """Drop every page (only when no request holds any: the caller checks); returns them."""
        if self.evictable != self.pages:
            raise RuntimeError("pages of the cache are in use")
        stats = self.stats
        pages = self.pages_of(list(self.nodes()))
        self.__init__(self.page_size, self.lookahead)
        self.stats = stats
        return pages
