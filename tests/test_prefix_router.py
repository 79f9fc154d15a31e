"""--load-balance-method cache_aware (server/prefix_router.py) on plain data: a prompt goes where its
prefix went before, unless the match is short or the ranks are out of balance; then to the least
loaded rank, which learns the prompt."""
from __future__ import annotations

from server.prefix_router import BALANCE_ABS, BLOCK, MAX_BLOCKS, RankPrefixes, block_hashes, choose


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_prompt_follows_its_prefix_when_the_ranks_are_balanced():
    prefixes = [RankPrefixes() for _ in range(3)]
    system = prompt(1000, 8 * BLOCK)
    assert choose(system + [1, 2], [0, 0, 0], prefixes) == 0          # nothing seen: least loaded
    assert choose(prompt(5000, 4 * BLOCK), [1, 0, 0], prefixes) == 1
    assert choose(system + [7, 8, 9], [5, 0, 3], prefixes) == 0        # its prefix is on rank 0
    assert choose(system[:2 * BLOCK] + prompt(9000, 6 * BLOCK), [5, 0, 3], prefixes) == 1   # a short match


def test_imbalance_overrides_the_match_and_the_least_loaded_rank_learns_the_prompt():
    prefixes = [RankPrefixes() for _ in range(2)]
    system = prompt(1000, 8 * BLOCK)
    choose(system, [0, 0], prefixes)
    assert choose(system + [1], [BALANCE_ABS + 10, 2], prefixes) == 1
    assert prefixes[1].matched(block_hashes(system)) == 8
    assert choose(system + [2], [3, 2], prefixes) == 1                 # both hold it now: the less loaded


def test_hashes_cover_whole_prefixes_and_old_blocks_go_first():
    assert block_hashes(prompt(0, BLOCK - 1)) == []
    a, b = block_hashes(prompt(0, 2 * BLOCK)), block_hashes(prompt(1, BLOCK) + prompt(BLOCK, BLOCK))
    assert a[1] != b[1]                                # the same second block after another first block
    rank = RankPrefixes()
    rank.insert(a)
    rank.insert([hash(i) for i in range(MAX_BLOCKS)])
    assert rank.matched(a) == 0 and len(rank.blocks) == MAX_BLOCKS
