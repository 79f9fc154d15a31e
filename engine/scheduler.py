"""Continuous batching with chunked prefill, a token budget and retraction.
Pure Python: no tensors, no device calls (tested on plain data).

Every step the scheduler feeds each running request the tokens whose K/V are not yet
scheduled: the decode policy (engine/policy.py) says how decoding requests are fed (one token,
or a speculative draft/verify run); prefilling requests get a chunk of known tokens. A
sequence "samples" when its fed tokens reach the end of what is known; its output goes to a
future-map slot.

NOTE: with overlap, schedule(N+1) runs before process(N). Invariant at schedule time for a
request decoding plainly: kv_len == known_len + pending - 1 (with speculation kv_len is an upper
bound; spec/policy.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.batch import Admission, ScheduledBatch, SeqWork, StepOutput
from engine.kv_pool import KVPool
from engine.messages import SamplingParams
from engine.policy import DecodePolicy, PlainDecoding
from engine.request import Request, Status
from engine.stats import Stat, gauge

if TYPE_CHECKING:
    from engine.grammar import Grammar

__all__ = ["ScheduledBatch", "Scheduler", "SchedulerConfig", "SeqWork", "StepOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_queued_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    context_length: int
    future_slots: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, eos_ids: frozenset[int],
                 policy: DecodePolicy | None = None):
        self.config = config
        self.pool = pool
        self.eos_ids = eos_ids
        self.policy = policy or PlainDecoding()
        self.waiting: deque[Request] = deque()
        self.reserving: deque[Request] = deque()      # prefilled elsewhere: waiting for room for their KV
        self.reserved: dict[str, Request] = {}        # room reserved: their KV is arriving
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.next_future = 0
        self.retractions = 0

    # ---- intake ------------------------------------------------------------------

    def add(self, rid: str, input_ids: list[int], params: SamplingParams, remote: bool = False,
            grammar: "Grammar | None" = None) -> str | None:
        """Queue a request; returns an error message if it can never run here. A remote request is
        prefilled elsewhere: it waits for room for its KV (reserve_remote), then for the KV. A request
        with params.grammar comes with its matcher (engine/grammar.py)."""
        error = self.refusal(rid, input_ids, params)
        if error:
            return error
        if (params.grammar is None) != (grammar is None):
            return "a constrained request needs its compiled grammar"
        req = Request(rid, list(input_ids), params, self.eos_ids, self.policy.new_record(), grammar)
        self.requests[rid] = req
        if remote:
            req.status = Status.RESERVING
            self.reserving.append(req)
        else:
            self.policy.on_arrival(idle=not self.running)
            self.waiting.append(req)
        return None

    def reserve_remote(self) -> list[Request]:
        """Rows and pages for the prompts of remote requests (and their first decode step), oldest
        first, as far as they fit; returns those that got them (their prefill may start)."""
        done = []
        while self.reserving and self.can_reserve(self.reserving[0]):
            req = self.reserving.popleft()
            req.row, req.status = self.pool.take_row(), Status.RESERVED
            self.pool.grow(req.pages, len(req.input_ids) + self.policy.growth)
            self.reserved[req.rid] = req
            done.append(req)
        return done

    def can_reserve(self, req: Request) -> bool:
        need = self.pool.pages_for(len(req.input_ids) + self.policy.growth)
        reserve = self.pool.pages_for(len(self.running) * self.policy.growth)    # everyone's next step
        return (bool(self.pool.free_rows) and len(self.running) + len(self.reserved) < self.config.max_running_requests
                and need + reserve <= self.pool.free_count)

    def activate(self, req: Request, first_token: int, logprob: float | None,
                 top: list[tuple[int, float]] | None, record: dict) -> None:
        """A reserved request's KV has arrived, and its first token: it decodes from now on."""
        self.reserved.pop(req.rid)
        self.policy.import_record(req, record)
        req.kv_len, req.prefilled, req.status = len(req.input_ids), True, Status.RUNNING
        self.running.append(req)
        req.output_ids.append(first_token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(list(top or []))
        if req.check_finish(first_token, self.config.context_length):
            self.finish(req)

    def refusal(self, rid: str, input_ids: list[int], params: SamplingParams) -> str | None:
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
        return None

    def admit_imported(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids: list[int],
                       kv_len: int, record: dict) -> tuple[Request | None, str | None]:
        """A request that ran elsewhere up to a step boundary: its KV holds positions [0, kv_len) and
        its last output is fed next. It gets a row and pages for them plus one decode step, and runs
        (the caller writes its KV and device state into them). Returns it, or why it cannot run here."""
        error = self.refusal(rid, input_ids, params)
        if error:
            return None, error
        if params.grammar is not None:
            return None, "a constrained request does not move between ranks"
        if not self.pool.free_rows or not self.pool.can_grow([], kv_len + self.policy.growth) \
                or len(self.running) >= self.config.max_running_requests:
            return None, "no room for it now"
        req = Request(rid, list(input_ids), params, self.eos_ids, self.policy.new_record())
        req.output_ids = list(output_ids)
        self.policy.import_record(req, record)
        req.row, req.kv_len, req.prefilled, req.status = self.pool.take_row(), kv_len, True, Status.RUNNING
        self.pool.grow(req.pages, kv_len + self.policy.growth)
        self.requests[rid] = req
        self.running.append(req)
        return req, None

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

    def stats(self) -> list[Stat]:
        # steps and retractions have always been served as gauges: their type stays what dashboards know
        return [gauge("tandem_num_running_reqs", "Requests decoding now.", len(self.running)),
                gauge("tandem_num_waiting_reqs", "Requests waiting for admission.", len(self.waiting)),
                gauge("tandem_steps_total", "Scheduler steps run so far.", self.step),
                gauge("tandem_retractions_total", "Requests retracted for lack of KV space so far.", self.retractions),
                gauge("tandem_kv_slots_owned", "KV cache slots in pages that requests hold as their own (not the "
                      "cached pages they read): with the free and the cached ones, every slot.", self.owned_slots)]

    @property
    def owned_slots(self) -> int:
        """Counted from the requests, apart from the free list and the cache, so that a soak can check
        that the three add up to the pool (bench/soak_pages.py)."""
        holders = [*self.running, *self.reserved.values()]
        return sum(len(r.pages) - len(r.cache_path) for r in holders) * self.pool.page_size

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(r.pending == 0 for r in self.waiting)

    # ---- scheduling ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self.step += 1
        batch = ScheduledBatch(step=self.step, seqs=[], input_ids=[], spec=self.policy.new_plan())
        decodes = [r for r in self.running if self.policy.is_decoding(r)]
        if self.policy.decodes_now(self, decodes):
            self.make_room_for(decodes)
            decodes = [r for r in decodes if r.status is Status.RUNNING]
            if self.policy.plan_decodes(self, batch, decodes):
                return batch
        self.plan_prefill(batch)
        while not batch.seqs and self.stuck():
            self.retract(self.running[-1])       # prompts that cannot grow, nothing else to run: make room
            self.plan_prefill(batch)
        if not batch.seqs:
            return None
        self.policy.end_prefill_plan(self, batch)
        return batch

    def plan_prefill(self, batch: ScheduledBatch) -> None:
        """Prompt chunks of running requests, then newly admitted ones, within the step's budget."""
        budget = self.config.max_prefill_tokens
        for req in [r for r in self.running if not self.policy.is_decoding(r)]:
            budget -= self.feed_chunk(batch, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if req.pending:
                break
            path = self.cached_prefix(req)
            if not self.can_admit(req, budget, len(path) * self.pool.page_size):
                break
            self.waiting.popleft()
            req.row = self.pool.take_row()
            req.status = Status.RUNNING
            self.running.append(req)
            self.start_from_cache(batch, req, path)
            batch.admitted.append(Admission(req.rid, req.known_len, req.kv_len))
            budget -= self.feed_chunk(batch, req, budget)

    def prefill_ready(self) -> bool:
        """Run a prefill batch now (new or chunked prompts can make progress: a prompt's next chunk
        fits in the free pages; one that does not waits for decodes to free some)."""
        if any(self.chunk_fits(r) for r in self.running if not self.policy.is_decoding(r)):
            return True
        return (bool(self.waiting) and self.waiting[0].pending == 0
                and len(self.running) < self.config.max_running_requests
                and self.can_admit(self.waiting[0], self.config.max_prefill_tokens))

    def chunk_fits(self, req: Request) -> bool:
        size = min(req.known_len - req.kv_len, self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        return size > 0 and self.pool.can_grow(req.pages, req.kv_len + size)

    def can_admit(self, req: Request, budget: int, cached: int = 0) -> bool:
        if not self.pool.free_rows:
            return False
        chunk = min(req.known_len - cached, self.config.chunked_prefill_size, budget)
        reserve = len(self.running) * self.policy.growth     # next decode step of everyone running
        return self.pool.pages_for(chunk) + self.pool.pages_for(reserve) <= self.pool.free_count

    # ---- the prefix cache (engine/radix_cache.py) --------------------------------------------

    def cached_prefix(self, req: Request) -> list:
        """The cache's longest path for the request's known tokens, leaving at least one to compute
        (its logits are what the prefill is for)."""
        cache = self.pool.cache
        return cache.match(req.all_ids, req.known_len - 1) if cache else []

    def start_from_cache(self, batch: ScheduledBatch, req: Request, path: list) -> None:
        """An admitted request reads the cached pages of its prefix: they head its pages, the batch maps
        its positions there, and its prefill starts after them."""
        cache = self.pool.cache
        if cache is None:
            return
        cached = len(path) * self.pool.page_size
        cache.stats.prompt_tokens += req.known_len
        cache.stats.hit_tokens += cached
        if req.retractions == 0:
            req.cached_tokens = cached
        if not path:
            return
        cache.lock(path)
        req.cache_path, req.pages = path, cache.pages_of(path)
        req.kv_len = req.written = cached
        batch.table_rows.extend([req.row] * cached)
        batch.table_pos.extend(range(cached))
        batch.table_slots.extend(self.pool.slots(req.pages, 0, cached))
        self.policy.on_cached(req, cached)

    def flush_cache(self) -> str:
        """Empty the prefix cache: every page it holds back to the free list. Refused (the reason
        returned) while any request is here: a running one reads cached pages."""
        if self.running or self.waiting or self.reserving or self.reserved:
            return "requests are running or waiting"
        if self.pool.cache is not None:
            self.pool.free_pages.extend(self.pool.cache.flush())
        return ""

    def release_pages(self, req: Request, keep: bool) -> None:
        """Return the request's pages: with `keep`, the full pages of K/V that processed steps wrote go
        to the cache first (the tree keeps those it lacked); the cached pages it read are unlocked."""
        cache, pages = self.pool.cache, req.pages
        if cache is not None:
            full = min(self.policy.cacheable(req), req.known_len - 1) // self.pool.page_size if keep else 0
            held = req.cache_path
            full = max(full, len(held))
            spare = cache.insert(req.all_ids, pages[:full], after=held) if full > len(held) else []
            cache.unlock(held)
            self.pool.free_pages.extend(reversed(spare))
            pages = pages[full:]
            req.cache_path = []
        self.pool.release(pages)
        req.pages = []

    def stuck(self) -> bool:
        """Requests run, none has a step in flight, and this step could feed none of them."""
        return len(self.running) > 1 and all(r.pending == 0 for r in self.running)

    def make_room_for(self, decodes: list[Request]) -> None:
        """Retract the newest running requests until every decode can grow by one step."""
        growth = self.policy.growth

        def pages_needed() -> int:
            return sum(self.pool.pages_for(r.kv_len + growth) - len(r.pages)
                       for r in decodes if r.status is Status.RUNNING)
        while pages_needed() > self.pool.free_count and self.running:
            self.retract(self.running[-1])

    def retract(self, req: Request) -> None:
        """Free a running request's KV and queue it for recompute (prompt + outputs so far).
        An output still in flight lands in output_ids when its batch is processed."""
        self.running.remove(req)
        self.release_pages(req, keep=True)
        self.pool.give_row(req.row)
        req.row, req.kv_len, req.written, req.status, req.prefilled = None, 0, 0, Status.WAITING, False
        self.policy.on_retract(req)
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

    def feed(self, batch: ScheduledBatch, req: Request, size: int, decode: bool = False) -> None:
        """Feed the next `size` positions of the request: known tokens, or the future in flight."""
        start, end = req.kv_len, req.kv_len + size
        self.allocate(batch, req, end)
        if req.pending:
            batch.input_ids.append(-req.future_id)
        else:
            batch.input_ids.extend(req.all_ids[start:end])
        seq = SeqWork(req=req, row=req.row, start=start, q_len=size, last_chunk=end >= req.known_len,
                      decode=decode, noise_key=end)
        if seq.last_chunk:
            req.prefilled = True
            seq.future_id = req.future_id = self.take_future()
            req.pending += 1
            batch.sample_params.append(req.params)
        req.kv_len = end
        batch.seqs.append(seq)
        self.policy.on_fed(batch, seq)

    def tokens_left(self, req: Request) -> int:
        """Tokens the request may still emit, counting only those processed: up to max_tokens and
        the context."""
        return min(req.params.max_new_tokens - len(req.output_ids), self.config.context_length - req.known_len)

    def take_future(self) -> int:
        """Ring of future-map slots; slot 0 is never used (-0 is not a reference)."""
        self.next_future = self.next_future % (self.config.future_slots - 1) + 1
        return self.next_future

    # ---- results -------------------------------------------------------------------

    def process(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Apply a finished batch's outputs; returns the requests with news for the front."""
        touched = []
        for seq in batch.seqs:               # K/V this step wrote (a bound: positions past known_len - 1 are not)
            seq.req.written = max(seq.req.written, seq.start + max(seq.q_len, batch.steps))
        for i, seq in enumerate(batch.sampling):
            if seq.req.finished:
                continue                      # finished (or aborted) after this batch was scheduled
            seq.req.pending -= 1
            self.policy.on_output(self, batch, seq, out.tokens[i], out.rounds_of(i, batch.steps))
            self.append_run(seq.req, out, i)
            touched.append(seq.req)
        return touched

    def append_run(self, req: Request, out: StepOutput, i: int) -> None:
        """Append sampling seq i's tokens; a stop inside an accepted run cuts the run there."""
        for j, token in enumerate(out.tokens[i]):
            req.output_ids.append(token)
            if out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[i][j])
            if out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[i][j])
            if req.check_finish(token, self.config.context_length):
                self.finish(req)
                return

    def void(self, batch: ScheduledBatch) -> None:
        """A launched batch whose outputs will never be applied (its work never ran): forget its
        outputs in flight and send its unfinished requests back to recompute from what is known,
        as a retraction does (their device state is re-seeded by their next prefill)."""
        for seq in batch.sampling:
            if not seq.req.finished:
                seq.req.pending -= 1
                self.policy.on_void(batch, seq)
        for req in {id(seq.req): seq.req for seq in batch.seqs}.values():
            if req.status is Status.RUNNING:
                self.retract(req)

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
        if req.status in (Status.RUNNING, Status.RESERVED):
            if req.status is Status.RUNNING:
                self.running.remove(req)
            self.reserved.pop(req.rid, None)
            self.release_pages(req, keep=req.finish_reason != "error")
            self.pool.give_row(req.row)
            req.row = None
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RESERVING:
            self.reserving.remove(req)
        req.status = Status.FINISHED
        self.requests.pop(req.rid, None)
