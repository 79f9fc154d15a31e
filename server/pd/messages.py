"""Typed messages between a decode node and a prefill node (TCP, framed by engine/framing.py).

One union per direction: ToPrefill (decode -> prefill) and ToDecode (prefill -> decode); the
handshake and heartbeat messages are the framing's own. Every per-request message names its `rid`:
the request id the decode node chose (its "room"), under which both nodes and their ranks keep that
request's state. The KV and the first token travel as the ranks send them (KvLayer, PrefillDone of
engine/messages.py): nothing is translated on the way.
"""
from __future__ import annotations

import msgspec

from engine.messages import KvLayer, PrefillDone, SamplingParams


# ---- decode -> prefill -----------------------------------------------------------

class PrefillRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams


class AbortRoom(msgspec.Struct, tag=True):
    rid: str
    reason: str = "abort"


class RoomDone(msgspec.Struct, tag=True):
    """The decode side holds everything of this room; the prefill side drops what it kept."""
    rid: str


ToPrefill = PrefillRequest | AbortRoom | RoomDone


# ---- prefill -> decode -----------------------------------------------------------

class RoomFailed(msgspec.Struct, tag=True):
    rid: str
    reason: str


class Busy(msgspec.Struct, tag=True):
    """Not taken now (nothing of it was kept); the decode side may try another prefill node."""
    rid: str
    reason: str


ToDecode = KvLayer | PrefillDone | RoomFailed | Busy

