"""Typed messages between a decode node and a prefill node (TCP, see server/pd/wire.py).

One union per direction: ToPrefill (decode -> prefill) and ToDecode (prefill -> decode). Both hold
the handshake and liveness messages. Every per-request message names its `room`: the request id
the decode node chose, under which both sides keep that request's state.

NOTE: Hello must keep its fields across protocol versions (new fields only with defaults): it is
the one message a node of another version must still decode, to say which version it speaks.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from engine.messages import SamplingParams

if TYPE_CHECKING:
    import torch

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WireTensor(msgspec.Struct):
    """A host tensor as raw bytes in its own dtype (little-endian, C order)."""
    dtype: str
    shape: list[int]
    data: bytes


# dtype name -> bytes per element (the nodes' HTTP fronts relay these bytes without torch)
WIRE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def to_wire(tensor: torch.Tensor) -> WireTensor:
    """Copy a tensor (any device) to the host and take its bytes."""
    import torch
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise ValueError(f"cannot send a {name} tensor; expected one of {sorted(WIRE_DTYPES)}")
    host = tensor.detach().to("cpu")
    # reshape(-1) is a C-order copy when the tensor is not contiguous; numpy has no bfloat16, so the
    # bytes are taken through a uint8 view (of every dtype, for one path)
    raw = host.reshape(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8)
    return WireTensor(dtype=name, shape=list(host.shape), data=raw.numpy().tobytes())


def from_wire(wire: WireTensor) -> torch.Tensor:
    """A host tensor from its wire form; a clear ValueError for anything malformed."""
    import torch
    item_size = WIRE_DTYPES.get(wire.dtype)
    if item_size is None:
        raise ValueError(f"tensor of dtype {wire.dtype!r}; expected one of {sorted(WIRE_DTYPES)}")
    if any(size < 0 for size in wire.shape):
        raise ValueError(f"tensor of shape {wire.shape}: sizes must not be negative")
    expected = math.prod(wire.shape) * item_size
    if expected != len(wire.data):
        raise ValueError(f"tensor of shape {wire.shape} ({wire.dtype}) needs {expected} bytes, "
                         f"got {len(wire.data)}")
    dtype = getattr(torch, wire.dtype)
    if not wire.data:
        return torch.empty(wire.shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer it may share
    return torch.frombuffer(bytearray(wire.data), dtype=torch.uint8).view(dtype).view(wire.shape)


# ---- both ways: handshake and liveness -------------------------------------------

class Hello(msgspec.Struct, tag=True):
    version: int
    role: str                       # "prefill" or "decode" (a str, so a wrong one is refused by name)
    fingerprint: str                # server/pd/fingerprint.py: what both nodes must serve alike
    nonce: bytes = b""              # fresh random bytes with a secret; empty: this node has none


class Proof(msgspec.Struct, tag=True):
    mac: bytes                      # HMAC-SHA256 of the secret over both nonces (server/pd/wire.py)


class Welcome(msgspec.Struct, tag=True):
    pass


class Refused(msgspec.Struct, tag=True):
    reason: str


class Ping(msgspec.Struct, tag=True):
    pass


class Pong(msgspec.Struct, tag=True):
    pass


# ---- decode -> prefill -----------------------------------------------------------

class PrefillRequest(msgspec.Struct, tag=True):
    room: str
    input_ids: list[int]
    params: SamplingParams


class AbortRoom(msgspec.Struct, tag=True):
    room: str
    reason: str = "abort"


class RoomDone(msgspec.Struct, tag=True):
    """The decode side holds everything of this room; the prefill side drops what it kept."""
    room: str


ToPrefill = Hello | Proof | Welcome | Refused | Ping | Pong | PrefillRequest | AbortRoom | RoomDone


# ---- prefill -> decode -----------------------------------------------------------

class KvLayer(msgspec.Struct, tag=True):
    """K and V of positions [start, start + count) of one layer: data is [2, count, kv_heads, head_dim]."""
    room: str
    start: NonNegative
    count: NonNegative
    layer: NonNegative
    kind: Literal["target", "draft"]    # the target's cache, or the draft model's (or head's) own
    data: WireTensor


class PrefillDone(msgspec.Struct, tag=True):
    """The prompt's KV was sent before; the first token, and what the decode side's speculative
    worker (draft_row) and decode policy (record) need to go on."""
    room: str
    kv_len: NonNegative
    first_token: NonNegative
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    draft_row: dict[str, WireTensor] = {}
    record: dict = {}


class RoomFailed(msgspec.Struct, tag=True):
    room: str
    reason: str


class Busy(msgspec.Struct, tag=True):
    """Not taken now (nothing of it was kept); the decode side may try another prefill node."""
    room: str
    reason: str


ToDecode = Hello | Proof | Welcome | Refused | Ping | Pong | KvLayer | PrefillDone | RoomFailed | Busy


def incoming_union(role: str):
    """The union a node of `role` receives."""
    return {"prefill": ToPrefill, "decode": ToDecode}[role]
