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
from dataclasses import dataclass, field

from engine.stats import MEAN_MEASURED, Stat, counter, gauge

STALE_FACTOR = 4     # heap entries per evictable page (at least 64) past which the stale ones are swept out


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]                # the tokens of this page, and the lookahead after them (empty at the root)
    page: int                           # the pool page holding their K/V (-1 at the root)
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    ref: int = 0
    last_use: int = 0


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
        self.root = Node((), -1, None)
        self.pages = 0              # pages the tree holds
        self.evictable = 0          # ... of those, with ref 0
        self.stats = CacheStats()
        self.clock = itertools.count(1)
        self.leaves: list[tuple[int, int, Node]] = []   # (last_use, id, node): evictable leaves, and stale entries

    # ---- lookup --------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> list[Node]:
        """The longest cached path spelling a prefix of tokens[:limit], in whole pages (each followed in
        `tokens` by its lookahead)."""
        path, node, ps, now = [], self.root, self.page_size, next(self.clock)
        for start in range(0, limit - limit % ps, ps):
            node = node.children.get(self.key(tokens, start))
            if node is None:
                break
            node.last_use = now
            path.append(node)
        if path:
            self.offer(path[-1])                 # only the path's end can be a leaf
        return path

    def lock(self, path: list[Node]) -> None:
        """A request reads these pages: none of them may go."""
        for node in path:
            self.evictable -= node.ref == 0
            node.ref += 1

    def unlock(self, path: list[Node]) -> None:
        now = next(self.clock)
        for node in path:
            node.ref -= 1
            node.last_use = now
            self.evictable += node.ref == 0
            self.offer(node)

    # ---- insertion -------------------------------------------------------------------------

    def key(self, tokens: list[int], start: int) -> tuple[int, ...] | None:
        """The key of the page at `start`: its tokens and the lookahead (None where tokens end first)."""
        key = tuple(tokens[start:start + self.page_size + self.lookahead])
        return key if len(key) == self.page_size + self.lookahead else None

    def insert(self, tokens: list[int], pages: list[int], after: list[Node] | None = None) -> list[int]:
        """Cache the K/V of tokens[:len(pages) * page_size], held in `pages` (`tokens` goes on with the
        lookahead after them). The tree takes the pages it lacked; returns those it already held another
        copy of, or could not key (the caller frees them). A page that is already the tree's (a matched
        prefix) stays where it is. `after`: the path the request matched and still holds (locked, so in
        the tree; its pages head `pages`): the walk starts below it, not at the root, so a long shared
        prefix costs its readers nothing here (unlock stamps the path's last use)."""
        after = after or []
        node, ps, now, spare = (after[-1] if after else self.root), self.page_size, next(self.clock), []
        for i in range(len(after), len(pages)):
            page = pages[i]
            key = self.key(tokens, i * ps)
            if key is None:
                self.offer(node)
                return spare + pages[i:]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Node(key, page, node, last_use=now)
                self.pages += 1
                self.evictable += 1
                self.stats.inserted_pages += 1
            elif child.page != page:
                spare.append(page)
            child.last_use = now
            node = child
        self.offer(node)
        return spare

    # ---- eviction --------------------------------------------------------------------------

    def offer(self, node: Node) -> None:
        """`node` may have just become an evictable leaf, or been used while one: its entry, at its last_use."""
        if node is not self.root and node.ref == 0 and not node.children:
            heapq.heappush(self.leaves, (node.last_use, id(node), node))
            if len(self.leaves) > STALE_FACTOR * max(self.evictable, 64):
                self.sweep()

    def sweep(self) -> None:
        """Drop the stale entries (one pass over the heap, not the tree)."""
        self.leaves = [entry for entry in self.leaves if self.current(entry)]
        heapq.heapify(self.leaves)

    @staticmethod
    def current(entry: tuple[int, int, Node]) -> bool:
        """Is the entry its node's latest, with the node still in the tree, a leaf and read by no request?"""
        last_use, _, node = entry
        return (node.parent is not None and node.ref == 0 and not node.children and node.last_use == last_use)

    def evict(self, wanted: int) -> list[int]:
        """Free up to `wanted` pages, least recently used leaves with ref 0 first."""
        freed: list[int] = []
        while self.leaves and len(freed) < wanted:
            entry = heapq.heappop(self.leaves)
            if not self.current(entry):
                continue
            parent = entry[2].parent
            freed.append(self.remove(entry[2]))
            self.offer(parent)                   # a leaf now, where its last child went
        self.stats.evicted_pages += len(freed)
        return freed

    def remove(self, node: Node) -> int:
        del node.parent.children[node.key]
        node.parent = None                       # out of the tree: its heap entries are stale
        self.pages -= 1
        self.evictable -= 1
        return node.page

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

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
        pages = [node.page for node in self.nodes()]
        self.root.children.clear()
        self.leaves.clear()
        self.pages = self.evictable = 0
        return pages
