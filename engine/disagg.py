"""Prefill/decode disaggregation inside a rank: what a prefill rank sends out, and how a decode rank
takes it in. The nodes talk over TCP (server/pd/); a rank only talks to its own front.

Prefill rank (`AddRequest.mode == "prefill"`): the request runs as a prompt whose output is its
first token. Right after each of its chunks is launched, an export is launched behind it on the
stream (after the draft's read of the chunk too): the chunk's K and V, target and draft, go to the
front as KvLayer messages, in order. When the first token is processed, PrefillDone follows with
the speculative worker's per-row state and the decode policy's record; the request is then over
here and its slots are free (the export copied what it needed).

Decode rank (`mode == "decode"`): the request waits for a row and pages for its prompt plus one
decode step (Scheduler.reserve_remote); PrefillReserved tells the front, which asks a prefill
node. Arriving KvLayer messages are written into the reserved slots on the stream; PrefillDone
activates the request (its first token is streamed) and it joins the running batch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from engine.messages import KvLayer, PrefillDone, PrefillReserved
from engine.request import Request, Status
from engine.wire_tensor import from_wire, to_wire

if TYPE_CHECKING:
    from devices.base import Launched
    from engine.core import EngineCore, InFlight
    from engine.framing import Connection

log = logging.getLogger(__name__)
@dataclass
class ChunkExport:
    rid: str
    start: int
    count: int
    launched: "Launched"


@dataclass
class FirstToken:
    req: Request


class PrefillExporter:
    """A prefill rank's side: exports launched behind the chunks, sent to the front in order."""

    def __init__(self, core: "EngineCore", channel: "Connection"):
        self.core, self.channel = core, channel
        self.rids: set[str] = set()
        self.exported: dict[str, int] = {}           # positions of each prompt whose export is launched
        self.started: dict[str, float] = {}          # for the trace: when each prefill arrived
        self.outbox: asyncio.Queue = asyncio.Queue()
        core.launch_observers.append(self.export_chunks)

    def add(self, rid: str) -> None:
        """Export the prefill of `rid` (just added to the scheduler): its KV, the draft's too, and its
        first token leave for a decode node."""
        self.core.scheduler.requests[rid].exported = True
        self.rids.add(rid)
        self.exported[rid] = 0
        self.started[rid] = time.perf_counter()

    def export_chunks(self, flight: "InFlight") -> None:
        """Right after a batch is launched: launch the export of its prefill-only chunks."""
        runner, pool = self.core.runner, self.core.scheduler.pool
        for seq in flight.batch.seqs:
            if seq.req.rid not in self.rids or seq.decode:
                continue                 # (with overlap, a decode of its first token may follow: not exported)
            # from where the last export ended: a prompt that began in the prefix cache sends the cached
            # positions with its first chunk (a retracted one sends again what it recomputes)
            start, end = min(self.exported[seq.req.rid], seq.start), seq.start + seq.q_len
            self.exported[seq.req.rid] = end
            slots = pool.slots(seq.req.pages, start, end)
            row = seq.row if seq.last_chunk else None
            launched = runner.device.launch(lambda row=row, slots=slots: runner.export_chunk(row, slots))
            self.outbox.put_nowait(ChunkExport(seq.req.rid, start, end - start, launched))

    def finished(self, req: Request) -> bool:
        """A prefill-only request has news: its end. Queue its PrefillDone (or let its error through)."""
        if req.rid not in self.rids:
            return False
        self.rids.discard(req.rid)
        self.exported.pop(req.rid, None)
        started = self.started.pop(req.rid, None)
        if req.finish_reason in ("length", "stop"):
            self.core.tracer.span("transfer", f"prefill out {req.rid}", started, time.perf_counter(),
                                  tokens=len(req.input_ids))
            self.outbox.put_nowait(FirstToken(req))
            return True
        return False

    async def run(self) -> None:
        """Send what was queued, in order (a chunk's export resolves after the batch it follows)."""
        draft_rows: dict[str, dict] = {}
        while True:
            item = await self.outbox.get()
            if isinstance(item, ChunkExport):
                await self.send_chunk(item, draft_rows)
            else:
                self.send_done(item.req, draft_rows.pop(item.req.rid, {}))

    async def send_chunk(self, item: ChunkExport, draft_rows: dict[str, dict]) -> None:
        try:
            target, draft, draft_row = await item.launched
        except Exception as exc:       # its request fails through the core; nothing to send
            log.warning("export of %s failed: %r", item.rid, exc)
            return
        for kind, layers in (("target", target), ("draft", draft)):
            for layer, pair in enumerate(layers):
                self.channel.send_nowait(KvLayer(item.rid, item.start, item.count, layer, kind, to_wire(pair)))
        if draft_row:
            draft_rows[item.rid] = {name: to_wire(t) for name, t in draft_row.items()}
        await self.channel.writer.drain()

    def send_done(self, req: Request, draft_row: dict) -> None:
        logprob = req.output_logprobs[0] if req.output_logprobs else None
        top = req.output_top_logprobs[0] if req.output_top_logprobs else None
        record = self.core.scheduler.policy.export_record(req)
        self.channel.send_nowait(PrefillDone(req.rid, len(req.input_ids), req.output_ids[0], logprob, top,
                                             draft_row, record))


class RemoteKv:
    """A decode rank's side: reservations, arriving KV and activation."""

    def __init__(self, core: "EngineCore", channel: "Connection"):
        self.core, self.channel = core, channel
        self.writes: set[asyncio.Task] = set()
        self.failed: list[Request] = []       # failed by a write on the stream: news for the rank
        self.reserved_at: dict[str, float] = {}    # for the trace: reservation to activation

    def reserve(self) -> None:
        """Tell the front about every request that just got room for its KV."""
        reserved = self.core.scheduler.reserved
        for rid in [rid for rid in self.reserved_at if rid not in reserved]:
            del self.reserved_at[rid]             # aborted before its KV came
        for req in self.core.scheduler.reserve_remote():
            self.reserved_at[req.rid] = time.perf_counter()
            self.channel.send_nowait(PrefillReserved(req.rid))

    def take_failed(self) -> list[Request]:
        failed, self.failed = self.failed, []
        return failed

    def reserved(self, rid: str) -> Request | None:
        req = self.core.scheduler.reserved.get(rid)
        return req if req is not None and req.status is Status.RESERVED else None

    def write(self, msg: KvLayer) -> list[Request]:
        """One layer of arriving KV into the reserved slots; a malformed block fails the request."""
        req = self.reserved(msg.rid)
        if req is None:
            return []                              # aborted meanwhile
        try:
            pair = from_wire(msg.data)
            if msg.start < 0 or msg.start + msg.count > len(req.input_ids):
                raise ValueError(f"positions {msg.start}..{msg.start + msg.count} of a "
                                 f"{len(req.input_ids)}-token prompt")
        except ValueError as exc:
            return self.fail(req, f"bad KV from the prefill node: {exc}")
        slots = self.core.scheduler.pool.slots(req.pages, msg.start, msg.start + msg.count)
        runner = self.core.runner
        self.watch(req, runner.device.launch(lambda: runner.write_kv_layer(slots, msg.layer, msg.kind, pair)))
        return []

    def activate(self, msg: PrefillDone) -> list[Request]:
        """The prompt's KV is in: the request decodes from its first token on."""
        req = self.reserved(msg.rid)
        if req is None:
            return []
        try:
            draft_row = {name: from_wire(tensor) for name, tensor in msg.draft_row.items()}
        except ValueError as exc:
            return self.fail(req, f"bad draft state from the prefill node: {exc}")
        if msg.kv_len != len(req.input_ids):
            return self.fail(req, f"the prefill node sent {msg.kv_len} positions for {len(req.input_ids)}")
        if req.grammar is not None and not req.grammar.accept(msg.first_token):
            return self.fail(req, f"the prefill node's first token {msg.first_token} does not match the grammar")
        pool, runner = self.core.scheduler.pool, self.core.runner
        slots = pool.slots(req.pages, 0, len(req.pages) * pool.page_size)
        token_ids = req.input_ids + [msg.first_token]
        self.watch(req, runner.device.launch(
            lambda: runner.activate_row(req.row, slots, draft_row, token_ids, msg.kv_len)))
        self.core.scheduler.activate(req, msg.first_token, msg.logprob, msg.top_logprobs, msg.record)
        started = self.reserved_at.pop(req.rid, time.perf_counter())
        self.core.tracer.span("transfer", f"kv in {req.rid}", started, time.perf_counter(), tokens=msg.kv_len)
        return [req]

    def fail(self, req: Request, message: str) -> list[Request]:
        self.core.scheduler.fail(req, message)
        return [req]

    def watch(self, req: Request, launched: "Launched") -> None:
        """A write on the stream that fails fails its request (reported by the rank's next news)."""
        async def wait() -> None:
            try:
                await launched
            except Exception as exc:       # a device error writing the KV
                log.error("writing the KV of %s failed: %r", req.rid, exc)
                self.core.scheduler.fail(req, f"writing its KV failed: {exc}")
                self.failed.append(req)
        task = asyncio.ensure_future(wait())
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)


def prefill_params(params):
    """A prefill node samples the first token only."""
    return msgspec.structs.replace(params, max_new_tokens=1)
