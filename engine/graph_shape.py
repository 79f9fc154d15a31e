"""Which captured graph a step's target forward replays, decided on the CPU from the scheduled batch
(pure Python: the scheduler's side of graphs), and how a DP-attention group agrees on one.

A graph's shapes are fixed by its kind (a plain decode: one token per row; a verify: chain + 1), its
padded batch size and the key positions attention reads (`width`, a bucket of the batch's longest
sequence, so that a step reads at most about twice the keys it needs). With DP attention every rank
pads to the same size and width, and a graph runs only if every rank can run it; a rank with no batch
replays it with padding only.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_WIDTH = 64          # the narrowest key width captured
KINDS = ("decode", "verify")
NO_GRAPH, ANY_GRAPH = 0, -1     # DP exchange: this rank's step runs eagerly / this rank has no batch


@dataclass(frozen=True)
class GraphShape:
    """A step's target forward as a captured graph: `kind` over `rows` rows (the group's most, under
    DP attention) of chain + 1 tokens each, reading `width` key positions."""
    kind: str
    rows: int
    chain: int
    width: int

    def encode(self) -> list[int]:
        return [KINDS.index(self.kind) + 1, self.rows, self.chain, self.width]


def key_width(max_kv: int, page_size: int, table_width: int) -> int:
    """The key positions a captured step reads for sequences of at most max_kv positions: the next
    power of two (at least MIN_WIDTH), in whole pages, never past the slot table."""
    width = max(MIN_WIDTH, 1 << max(0, max_kv - 1).bit_length())
    return min(table_width, -(-width // page_size) * page_size)


def key_widths(page_size: int, table_width: int) -> list[int]:
    """Every width key_width gives, ascending: what graphs are captured for at start-up."""
    widths, longest = [], MIN_WIDTH
    while not widths or widths[-1] < table_width:
        width = key_width(longest, page_size, table_width)
        if not widths or width > widths[-1]:
            widths.append(width)
        longest *= 2
    return widths


def encode_for_group(shape: GraphShape | None, has_batch: bool) -> list[int]:
    """This rank's entry of the DP exchange: kind code (NO_GRAPH, ANY_GRAPH without a batch), rows,
    chain, width."""
    if not has_batch:
        return [ANY_GRAPH, 0, 0, 0]
    return shape.encode() if shape is not None else [NO_GRAPH, 0, 0, 0]


def agreed_graph(entries: list[list[int]]) -> GraphShape | None:
    """The graph every rank of a group runs, from every rank's encode_for_group entry: the same kind
    and chain on every rank that has a batch, the most rows and the widest width; None (all eager)
    when some rank cannot or the ranks differ."""
    busy = [entry for entry in entries if entry[0] != ANY_GRAPH]
    if not busy or any(entry[0] == NO_GRAPH for entry in busy):
        return None
    if len({(entry[0], entry[2]) for entry in busy}) > 1:
        return None
    code, _, chain, _ = busy[0]
    return GraphShape(KINDS[code - 1], max(entry[1] for entry in busy), chain, max(entry[3] for entry in busy))
