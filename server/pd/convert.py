"""Between a rank's messages (engine/messages.py: `rid`, KvBlock) and the wire's (server/pd/messages.py:
`room`, WireTensor): the same fields under the names each side uses; the bytes are not copied."""
from __future__ import annotations

from engine.messages import KvBlock
from engine.messages import KvLayer as RankKvLayer
from engine.messages import PrefillDone as RankPrefillDone
from server.pd.messages import KvLayer, PrefillDone, WireTensor


def wire(block: KvBlock) -> WireTensor:
    return WireTensor(dtype=block.dtype, shape=block.shape, data=block.data)


def block(tensor: WireTensor) -> KvBlock:
    return KvBlock(dtype=tensor.dtype, shape=tensor.shape, data=tensor.data)


def to_pd(msg: RankKvLayer | RankPrefillDone, room: str) -> KvLayer | PrefillDone:
    if isinstance(msg, RankKvLayer):
        return KvLayer(room, msg.start, msg.count, msg.layer, msg.kind, wire(msg.block))
    return PrefillDone(room, msg.kv_len, msg.first_token, msg.logprob, msg.top_logprobs,
                       {name: wire(b) for name, b in msg.draft_row.items()}, msg.record)


def to_rank(msg: KvLayer | PrefillDone, rid: str) -> RankKvLayer | RankPrefillDone:
    if isinstance(msg, KvLayer):
        return RankKvLayer(rid, msg.start, msg.count, msg.layer, msg.kind, block(msg.data))
    return RankPrefillDone(rid, msg.kv_len, msg.first_token, msg.logprob, msg.top_logprobs,
                           {name: block(t) for name, t in msg.draft_row.items()}, msg.record)
