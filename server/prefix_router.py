"""--load-balance-method cache_aware: send a request to the rank whose prefix cache most likely holds
its prompt's beginning, balanced against load (the policy of sglang-router's cache-aware router).

The front does not see the ranks' caches; it keeps an approximate one per rank: the prompts it sent
there, as chained hashes of BLOCK-token blocks (block i's hash covers every token before its end, so
a set of them spells prefixes, as a radix tree's paths do), least recently used first out past
MAX_BLOCKS. A rank's match for a prompt is how many of its leading blocks that rank has seen.

  the best match covers at least MATCH_SHARE of the prompt, and the ranks are balanced (the busiest
  runs at most BALANCE_ABS more requests than the idlest, or at most BALANCE_REL times as many)
      -> the rank with the longest match (the less loaded of equals)
  otherwise
      -> the least loaded rank (its approximate cache learns the prompt all the same)

Approximate because a rank evicts on its own and a restarted rank starts empty; a wrong guess costs
a cache miss, never a wrong answer.
"""
from __future__ import annotations

from collections import OrderedDict

BLOCK = 16              # tokens a block
MAX_BLOCKS = 65536      # blocks remembered per rank
MATCH_SHARE = 0.5
BALANCE_ABS = 32
BALANCE_REL = 1.5


def block_hashes(tokens: list[int]) -> list[int]:
    """One hash per whole block, each covering the whole prefix up to the block's end."""
    hashes, running = [], 0
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        running = hash((running, tuple(tokens[end - BLOCK:end])))
        hashes.append(running)
    return hashes


class RankPrefixes:
    """One rank's approximate cache."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: list[int]) -> int:
        count = 0
        for block in hashes:
            if block not in self.blocks:
                break
            count += 1
        return count

    def insert(self, hashes: list[int]) -> None:
        for block in hashes:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > MAX_BLOCKS:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


def balanced(loads: list[int]) -> bool:
    low, high = min(loads), max(loads)
    return high - low <= BALANCE_ABS or high <= BALANCE_REL * max(low, 1)


def choose(prompt: list[int], loads: list[int], prefixes: list[RankPrefixes]) -> int:
    """Index of the rank for the prompt (`loads`: requests each runs; parallel to `prefixes`)."""
    hashes = block_hashes(prompt)
    matches = [p.matched(hashes) for p in prefixes]
    best = max(matches)
    if best and best * BLOCK >= MATCH_SHARE * len(prompt) and balanced(loads):
        pick = min((i for i in range(len(loads)) if matches[i] == best), key=lambda i: loads[i])
    else:
        pick = min(range(len(loads)), key=lambda i: loads[i])
    prefixes[pick].insert(hashes)
    return pick
