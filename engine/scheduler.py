"""Continuous batching with chunked prefill, a token budget and retraction.
Pure Python: no tensors, no device calls (tested on plain data).

Every step the scheduler feeds each running request the tokens whose K/V are not
yet scheduled: one token for a decode (a known token, or the future output of the
batch in flight), a chunk of known tokens for a prefill. A sequence "samples" when
its fed tokens reach the end of what is known; its output goes to a future-map slot.

NOTE: with overlap, schedule(N+1) runs before process(N). Invariant at schedule
time for a decoding request: kv_len == known_len + pending - 1.

With speculation (spec_tokens = k+1 > 0) a decode step is a draft/verify run of
k+1 tokens whose start and accepted length live on the device. `kv_len` is then an
upper bound: each launched step adds k+1, each processed step gives back what it did
not accept, and the pages past the bound are returned. Prefill and speculative
decode go in separate batches (plain decodes under load join prefill batches, below).

An all-greedy step drafts no more tokens than its requests can still emit (max_new_tokens,
the context), and a request that must finish with the steps in flight is not fed again.

Under load (at least `spec_off_batch_size` decoding requests) speculation is off: the
decodes are scheduled as without speculation, one token each, in the same batch as prompt
chunks (`feed_plain`). To the worker such a decode is a one-token last chunk: its prefill
hook seeds kv_len and bonus from it. Its input is the request's future, which every step
stores (a speculative step: its last emitted token). Only a request with no drafting step
in flight (`drafting == 0`) can be fed so, since only then is its kv_len exact; were one in
flight, the decodes would go as a speculative step that drafts nothing (chain 0), which
also emits exactly one token. The rank never meets that case (load grows only through a
prefill batch, and the step before it is processed before the next is scheduled); a rank
further behind would.

A draft model that skipped plain steps catches up in the next drafting step; `draft_lag`
(tokens its draft has not read) is exact on the CPU because each of those steps emitted
exactly one token. Such a draft (`draft_skips_prefill`) also skips prefill batches under
load (`draft_skip`: as many requests running): a request whose prompt the draft did not
read starts decoding with draft_lag = P - 1 - draft_end (P prompt tokens, the draft read
the first draft_end), and once one of its chunks was skipped the later ones are too, so
what the draft lacks is always the tail its catch-up reads. A plain decode is such a
skipped last chunk, so the same rule counts its lag.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_pool import KVPool
from engine.messages import SamplingParams
from engine.request import Request, Status


SPEC_NOISE_BASE = 1 << 24      # keeps speculative steps' noise keys apart from token positions


@dataclass
class SeqWork:
    req: Request
    row: int
    start: int          # first position fed (speculative decode: an upper bound; the device knows)
    q_len: int          # tokens fed
    future_id: int = 0  # > 0 when this sequence samples; its output's future-map slot
    spec: bool = False  # a speculative draft/verify step
    last_chunk: bool = False
    noise_key: int = 0  # seeded sampling: what, besides the seed, fixes this step's random draws
    draft_lag: int = 0  # speculative decode: tokens the request's draft has not read yet (plain steps)
    plain: bool = False  # a decode under load, scheduled as without speculation (a one-token verify step)

    @property
    def samples(self) -> bool:
        return self.future_id > 0 or self.spec


@dataclass
class ScheduledBatch:
    step: int
    seqs: list[SeqWork]
    input_ids: list[int]        # flattened over seqs; -f means "the token in future slot f"
    table_rows: list[int] = field(default_factory=list)    # request->slot table entries this batch sets:
    table_pos: list[int] = field(default_factory=list)     #   table[row, pos] = slot, for every newly
    table_slots: list[int] = field(default_factory=list)   #   allocated position
    sample_params: list[SamplingParams] = field(default_factory=list)   # one per sampling seq
    draft_next: list[int] = field(default_factory=list)    # speculation, prefill: token after each chunk (-1: sampled)
    chain: int = 0              # speculative decode: draft tokens per request this step (k, or 0 under load)
    draft_skip: bool = False    # speculation, prefill: the draft model does not read these chunks

    @property
    def is_spec_decode(self) -> bool:
        return bool(self.seqs) and self.seqs[0].spec

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def sampling(self) -> list[SeqWork]:
        return [s for s in self.seqs if s.samples]

    @property
    def max_q(self) -> int:
        return max(s.q_len for s in self.seqs)

    @property
    def max_kv(self) -> int:
        return max(s.start + s.q_len for s in self.seqs)


@dataclass
class StepOutput:
    """What a finished batch produced, on the host: per sampling seq, the run of tokens
    it emits (one token, or a speculative step's accepted tokens plus the bonus)."""
    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_queued_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    context_length: int
    future_slots: int
    spec_tokens: int = 0     # k+1 tokens per speculative decode step; 0 without speculation
    spec_off_batch_size: int = 0   # decode batches this large draft nothing (0: always draft)
    draft_skips_prefill: bool = False   # the draft catches up on skipped prompt chunks too (standalone)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, eos_ids: frozenset[int]):
        self.config = config
        self.pool = pool
        self.eos_ids = eos_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.next_future = 0
        self.retractions = 0
        self.spec_off_steps = 0       # decode steps without speculation (under load)

    # ---- intake ------------------------------------------------------------------

    def add(self, rid: str, input_ids: list[int], params: SamplingParams) -> str | None:
        """Queue a request; returns an error message if it can never run here."""
        if rid in self.requests:
            return f"duplicate request id {rid!r}"
        if not input_ids:
            return "the prompt is empty"
        need = len(input_ids) + params.max_new_tokens
        if len(input_ids) >= self.config.context_length:
            return f"prompt of {len(input_ids)} tokens does not fit the context length {self.config.context_length}"
        if min(need, self.config.context_length) > self.pool.total_slots:
            return f"prompt plus max_new_tokens ({need}) exceeds the KV cache ({self.pool.total_slots} tokens)"
        if len(self.waiting) >= self.config.max_queued_requests:
            return "overloaded"
        req = Request(rid, list(input_ids), params, self.eos_ids)
        self.requests[rid] = req
        self.waiting.append(req)
        return None

    def abort(self, rid: str, reason: str) -> Request | None:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return None
        req.finish_reason = reason
        self.finish(req)
        return req

    def fail(self, req: Request, message: str) -> None:
        """End a request whose batch failed: finish_reason "error", everything it holds freed."""
        if not req.finished:
            req.finish_reason, req.error = "error", message
            self.finish(req)

    def void(self, batch: ScheduledBatch) -> None:
        """A launched batch whose outputs will never be applied (a step before it failed): forget
        its outputs in flight and send its unfinished requests back to recompute from what is
        known, as a retraction does (their device state is re-seeded by their next prefill)."""
        for seq in batch.sampling:
            req = seq.req
            if not req.finished:
                req.pending -= 1
                req.drafting -= seq.spec and batch.chain > 0
        for req in {id(seq.req): seq.req for seq in batch.seqs}.values():
            if req.status is Status.RUNNING:
                self.retract(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(r.pending == 0 for r in self.waiting)

    # ---- scheduling ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self.step += 1
        batch = ScheduledBatch(step=self.step, seqs=[], input_ids=[])
        spec = self.config.spec_tokens > 0
        decodes = [r for r in self.running if self.is_decoding(r)]
        if not (spec and self.prefill_ready() and not self.under_load(decodes)):
            self.make_room_for(decodes)
            decodes = [r for r in decodes if r.status is Status.RUNNING]
            if not spec:
                for req in decodes:
                    self.feed(batch, req, 1)
            else:
                wanted = {req.rid: self.tokens_wanted(req) for req in decodes}
                decodes = [r for r in decodes if wanted[r.rid] > 0]        # the rest finish with a step in flight
                if self.under_load(decodes) and not any(r.drafting for r in decodes):
                    self.spec_off_steps += 1
                    for req in decodes:
                        self.feed_plain(batch, req)                       # prompt chunks may join below
                else:
                    batch.chain = self.chain_length(decodes, max(wanted.values(), default=0))
                    for req in decodes:
                        self.feed_spec(batch, req)
                    if batch.seqs:
                        return batch
        budget = self.config.max_prefill_tokens
        for req in [r for r in self.running if not self.is_decoding(r)]:
            budget -= self.feed_chunk(batch, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if req.pending or not self.can_admit(req, budget):
                break
            self.waiting.popleft()
            req.row = self.pool.take_row()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= self.feed_chunk(batch, req, budget)
        if spec and batch.seqs:
            self.mark_draft_reads(batch)
        return batch if batch.seqs else None

    def mark_draft_reads(self, batch: ScheduledBatch) -> None:
        """A prefill batch: does the draft model read it, and how far each request's draft lags."""
        off = self.config.spec_off_batch_size
        batch.draft_skip = self.config.draft_skips_prefill and off > 0 and (
            len(self.running) >= off or any(seq.req.draft_end < seq.start for seq in batch.seqs))
        for seq in batch.seqs:
            req, end = seq.req, seq.start + seq.q_len
            if not batch.draft_skip:
                req.draft_end = end
            if seq.last_chunk:
                req.draft_lag = 0 if req.draft_end == end else end - 1 - req.draft_end

    def under_load(self, decodes: list[Request]) -> bool:
        """Speculation is off: as many decoding requests as --speculative-disable-by-batch-size."""
        off = self.config.spec_off_batch_size
        return off > 0 and len(decodes) >= off

    def chain_length(self, decodes: list[Request], most_wanted: int) -> int:
        """Draft tokens per request for a speculative decode step: none under load, and, for an
        all-greedy batch, never more than its requests can still use (most_wanted: the largest
        tokens_wanted among them).
        The cap depends on timing (what was processed when), so it is kept from sampling
        batches: a seeded request must see the same chain lengths in every run."""
        k = self.config.spec_tokens - 1
        if not decodes:
            return 0
        if self.under_load(decodes):
            self.spec_off_steps += 1
            return 0
        if not all(r.params.greedy for r in decodes):
            return k
        return max(0, min(k, most_wanted - 1))

    def tokens_wanted(self, req: Request) -> int:
        """Most tokens the request can still emit, given that every step in flight emits at least one."""
        return min(req.params.max_new_tokens - len(req.output_ids),
                   self.config.context_length - req.known_len) - req.pending

    def prefill_ready(self) -> bool:
        """Speculation: run a prefill batch now (new or chunked prompts can make progress)."""
        if any(not self.is_decoding(r) for r in self.running):
            return True
        return (bool(self.waiting) and self.waiting[0].pending == 0
                and len(self.running) < self.config.max_running_requests
                and self.can_admit(self.waiting[0], self.config.max_prefill_tokens))

    def is_decoding(self, req: Request) -> bool:
        if self.config.spec_tokens:
            return req.prefilled             # its last chunk is launched: the device holds its spec state
        return req.kv_len >= req.known_len - 1

    def can_admit(self, req: Request, budget: int) -> bool:
        if not self.pool.free_rows:
            return False
        chunk = min(req.known_len, self.config.chunked_prefill_size, budget)
        reserve = len(self.running) * (self.config.spec_tokens or 1)   # next decode step of everyone running
        return self.pool.pages_for(chunk) + self.pool.pages_for(reserve) <= len(self.pool.free_pages)

    def make_room_for(self, decodes: list[Request]) -> None:
        """Retract the newest running requests until every decode can grow by one token."""
        growth = self.config.spec_tokens or 1

        def pages_needed() -> int:
            return sum(self.pool.pages_for(r.kv_len + growth) - len(r.pages)
                       for r in decodes if r.status is Status.RUNNING)
        while pages_needed() > len(self.pool.free_pages) and self.running:
            self.retract(self.running[-1])

    def retract(self, req: Request) -> None:
        """Free a running request's KV and queue it for recompute (prompt + outputs so far).
        An output still in flight lands in output_ids when its batch is processed."""
        self.running.remove(req)
        self.pool.release(req.pages)
        self.pool.give_row(req.row)
        req.row, req.kv_len, req.status, req.prefilled, req.draft_lag = None, 0, Status.WAITING, False, 0
        req.draft_end, req.plain = 0, False
        req.retractions += 1
        self.retractions += 1
        self.waiting.appendleft(req)

    def feed_chunk(self, batch: ScheduledBatch, req: Request, budget: int) -> int:
        size = min(req.known_len - req.kv_len, self.config.chunked_prefill_size, budget)
        if size <= 0 or not self.pool.can_grow(req.pages, req.kv_len + size):
            return 0
        self.feed(batch, req, size)
        return size

    def allocate(self, batch: ScheduledBatch, req: Request, end: int) -> None:
        """Grow the request's pages to hold positions [0, end) and set the new table entries."""
        have = len(req.pages) * self.pool.page_size
        grown = self.pool.grow(req.pages, end)
        assert grown, "allocate() after a failed capacity check"
        new_end = len(req.pages) * self.pool.page_size
        if new_end > have:
            batch.table_rows.extend([req.row] * (new_end - have))
            batch.table_pos.extend(range(have, new_end))
            batch.table_slots.extend(self.pool.slots(req.pages, have, new_end))

    def feed(self, batch: ScheduledBatch, req: Request, size: int) -> None:
        start, end = req.kv_len, req.kv_len + size
        self.allocate(batch, req, end)
        if req.pending:
            batch.input_ids.append(-req.future_id)
        else:
            batch.input_ids.extend(req.all_ids[start:end])
        seq = SeqWork(req=req, row=req.row, start=start, q_len=size, last_chunk=end >= req.known_len, noise_key=end)
        if seq.last_chunk:
            req.prefilled = True
            seq.future_id = req.future_id = self.take_future()
            req.pending += 1
            batch.sample_params.append(req.params)
        if self.config.spec_tokens:       # the draft reads token t+1 at position t; a last chunk's is sampled
            batch.draft_next.append(-1 if seq.last_chunk else req.all_ids[end])
        req.kv_len = end
        batch.seqs.append(seq)

    def feed_spec(self, batch: ScheduledBatch, req: Request) -> None:
        """One speculative step: its chain+1 positions start where the device says."""
        size = batch.chain + 1
        self.allocate(batch, req, req.kv_len + size)
        # The KV bound depends on timing (when earlier steps were processed); the step count does not.
        req.spec_steps_launched += 1
        seq = SeqWork(req=req, row=req.row, start=req.kv_len, q_len=size, spec=True,
                      noise_key=SPEC_NOISE_BASE + req.spec_steps_launched, draft_lag=req.draft_lag)
        seq.future_id = req.future_id = self.take_future()      # its last emitted token: a plain decode's input
        batch.seqs.append(seq)
        req.draft_lag = req.draft_lag + 1 if batch.chain == 0 else 0
        req.drafting += batch.chain > 0
        req.plain = False
        batch.sample_params.append(req.params)
        req.kv_len += size
        req.pending += 1

    def feed_plain(self, batch: ScheduledBatch, req: Request) -> None:
        """Under load, a decode as without speculation (kv_len is exact: no drafting step in flight).
        Coming from speculative steps, the draft has read the positions before kv_len - 1 - draft_lag;
        mark_draft_reads counts what it lacks from there."""
        if not req.plain:
            req.draft_end, req.plain = req.kv_len - 1 - req.draft_lag, True
        self.feed(batch, req, 1)
        batch.seqs[-1].plain = True

    def take_future(self) -> int:
        """Ring of future-map slots; slot 0 is never used (-0 is not a reference)."""
        self.next_future = self.next_future % (self.config.future_slots - 1) + 1
        return self.next_future

    # ---- results -------------------------------------------------------------------

    def process(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Apply a finished batch's outputs; returns the requests with news for the front."""
        touched = []
        for i, seq in enumerate(batch.sampling):
            req = seq.req
            if req.finished:
                continue                      # finished (or aborted) after this batch was scheduled
            req.pending -= 1
            run = out.tokens[i]
            if seq.spec or seq.plain:             # spec_verify_ct: forwards that emitted for it while decoding
                req.spec_verify_ct += 1
            if seq.spec:
                req.drafting -= batch.chain > 0
                if req.status is Status.RUNNING:
                    self.give_back(req, seq.q_len - len(run))
            for j, token in enumerate(run):
                req.output_ids.append(token)
                if out.logprobs is not None:
                    req.output_logprobs.append(out.logprobs[i][j])
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i][j])
                if req.check_finish(token, self.config.context_length):
                    self.finish(req)          # a stop inside an accepted run cuts the run there
                    break
            touched.append(req)
        return touched

    def give_back(self, req: Request, unused: int) -> None:
        """A speculative step accepted fewer than chain+1 tokens: lower the KV bound and return
        whole pages past it (no launched step writes there: the bound covers all in flight)."""
        req.kv_len -= unused
        keep = self.pool.pages_for(req.kv_len)
        if len(req.pages) > keep:
            self.pool.release_tail(req.pages, keep)

    def finish(self, req: Request) -> None:
        """Free everything the request holds, exactly once. Safe while a batch that
        writes its slots is in flight: the device runs batches in order, so a later
        owner's writes land after it."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.pool.release(req.pages)
            self.pool.give_row(req.row)
            req.row = None
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.requests.pop(req.rid, None)
