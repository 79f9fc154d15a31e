"""Length-prefixed msgspec frames over asyncio streams (unix or TCP sockets)."""
from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec

HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024


class FrameError(ConnectionError):
    """The peer sent something that is not a valid frame; the connection must close."""


class Channel:
    """Typed send/receive of one message union over a stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 incoming: Any, max_frame: int = MAX_FRAME):
        self.reader, self.writer = reader, writer
        self.decoder = msgspec.msgpack.Decoder(incoming)
        self.encoder = msgspec.msgpack.Encoder()
        self.max_frame = max_frame

    def send_nowait(self, msg: Any) -> None:
        body = self.encoder.encode(msg)
        self.writer.write(HEADER.pack(len(body)) + body)

    async def send(self, msg: Any) -> None:
        self.send_nowait(msg)
        await self.writer.drain()

    async def recv(self) -> Any:
        """Next message; raises asyncio.IncompleteReadError at EOF, FrameError on garbage."""
        (size,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        if size > self.max_frame:
            raise FrameError(f"frame of {size} bytes exceeds the limit of {self.max_frame}")
        body = await self.reader.readexactly(size)
        try:
            return self.decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise FrameError(f"undecodable frame: {exc}") from exc

    def close(self) -> None:
        self.writer.close()
