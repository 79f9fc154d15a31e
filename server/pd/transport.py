"""How bytes move between a prefill node and a decode node (--disaggregation-transfer-backend).

A transport opens the decode side's stream to a prefill node and serves the prefill side's port;
both ends then speak engine/framing.py's frames over it (`pd_connection`). `tcp` (asyncio sockets) is the one built in;
an RDMA engine (Mooncake, NIXL) would register here and move the KV pages itself, leaving the control
frames to the stream.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from engine.framing import Connection

STREAM_LIMIT = 16 * 1024 * 1024   # asyncio's per-stream buffer
HEARTBEAT_INTERVAL_S = 5.0

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class TcpTransport:
    name = "tcp"

    async def connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port, limit=STREAM_LIMIT)

    async def serve(self, handler: Handler, host: str, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(handler, host, port, limit=STREAM_LIMIT)


TRANSPORTS: dict[str, type] = {"tcp": TcpTransport}


def transport(name: str):
    """The transport registered as `name` (the flag's choices are the registry's names)."""
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(f"disaggregation transfer backend {name!r}: choose one of {', '.join(TRANSPORTS)}") from None


def pd_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: Any) -> Connection:
    """A prefill/decode link over a transport's stream: long-lived between nodes, so with heartbeats."""
    return Connection(reader, writer, incoming, kind="pd", heartbeat_interval=HEARTBEAT_INTERVAL_S)
