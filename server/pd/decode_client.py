"""The decode node's engine client: its own ranks decode, prefill nodes prefill.

    generate(rid):  a decode rank reserves KV for the prompt and one decode step (PrefillReserved)
                 -> a prefill node prefills; its KV layers and PrefillDone go to that rank
                 -> the rank's TokenDeltas, the first token first, as on a unified node

A client that goes away aborts both: the rank frees the reservation, the prefill node the room.
A prefill that fails ends the request with a clear error (EngineFailed, or EngineDead when no
prefill node is reachable) after the rank has freed what it held.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

from engine.args import ServerArgs
from engine.messages import PrefillReserved, SamplingParams, TokenDelta
from server.engine_client import EngineDead, EngineFailed
from server.pd.fingerprint import node_fingerprint
from server.pd.prefill_links import PrefillFailed, PrefillLinks
from server.rank_client import RankEngineClient

log = logging.getLogger("tandem.pd")
FIRST_CONNECT_S = 30.0


class DecodeEngineClient(RankEngineClient):
    def __init__(self, args: ServerArgs, secret: bytes | None):
        super().__init__(args)
        self.prefill = PrefillLinks(args, secret)

    async def start(self):
        readies = await super().start()
        self.prefill.start(node_fingerprint(self.args, readies))
        if not await self.prefill.wait_up(FIRST_CONNECT_S):
            log.warning("no prefill node reachable yet (%s); requests fail until one is",
                        ", ".join(self.args.prefill_addr))
        return readies

    async def close(self) -> None:
        await self.prefill.close()
        await super().close()

    def is_healthy(self) -> bool:
        return super().is_healthy() and self.prefill.up() > 0

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       mode: str = "decode") -> AsyncIterator[TokenDelta]:
        deltas = super().generate(rid, input_ids, params, mode="decode")
        try:
            reserved = await anext(deltas)
            if not isinstance(reserved, PrefillReserved):
                raise EngineFailed(f"the decode rank answered {type(reserved).__name__} before reserving KV")
            await self.transfer(rid, input_ids, params)
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()              # before the end: aborts it in the rank, freeing its KV

    async def transfer(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """The prefill node's KV and first token, into the rank that reserved room for them."""
        if not self.prefill.up():
            raise EngineDead("no prefill node is reachable")
        try:
            async for msg in self.prefill.prefill(rid, input_ids, params):
                self.send(rid, msg)
        except PrefillFailed as exc:
            raise EngineFailed(f"prefill failed: {exc}") from None
