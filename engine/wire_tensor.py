"""A host tensor as raw bytes, the form KV and draft state take in messages (engine/messages.py).

torch is imported inside the functions: the HTTP front relays these bytes and never loads it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


class WireTensor(msgspec.Struct):
    """A host tensor as raw bytes in its own dtype (little-endian, C order)."""
    dtype: str
    shape: list[int]
    data: bytes


# dtype name -> bytes per element
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
