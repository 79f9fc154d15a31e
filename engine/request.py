"""A request's lifecycle on a rank, as plain data (no tensors).

KV of a request, by position (page_size tokens per page, `pages[i]` holds positions
[i*page_size, (i+1)*page_size)):

  [0, cached)             pages of the radix cache it matched at admission (read only; engine/radix_cache.py)
  [0, kv_len)             positions whose K/V a launched batch writes (or has written)
  [kv_len, capacity)      allocated but not yet scheduled (the tail of the last page)

Tokens: `all_ids = input_ids + output_ids` are known on the CPU. With overlap, up to
one more output per in-flight batch is still on the device: `pending` counts them and
`future_id` names the future-map slot of the newest. The token at position
len(all_ids) is that future.

How a request decodes (plainly, or speculatively) is the decode policy's business: its
bookkeeping of the request lives in `decode`, a record the policy made (engine/policy.py).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from engine.messages import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import Grammar


class Status(enum.Enum):
    WAITING = "waiting"        # not in the cache (new, or retracted for recompute)
    RESERVING = "reserving"    # its prefill happens elsewhere; waits for room for its KV
    RESERVED = "reserved"      # has a row and pages; its KV arrives from a prefill node
    RUNNING = "running"        # has a row and pages; prefilling (chunked) or decoding
    FINISHED = "finished"


class Request:
    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams, eos_ids: frozenset[int],
                 decode: object = None, grammar: "Grammar | None" = None):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        # structured outputs: the matcher (the stream's, engine/grammar.py); its stop tokens end the
        # grammar, and the request with it, even with ignore_eos
        self.grammar = grammar
        if grammar is not None:
            self.stop_ids |= grammar.stop_ids
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.status = Status.WAITING
        self.row: int | None = None
        self.pages: list[int] = []
        self.cache_path: list = []      # radix cache nodes whose pages head `pages` (read, not owned)
        self.cached_tokens = 0          # prompt tokens found in the cache at its first admission
        self.kv_len = 0
        self.written = 0              # positions whose K/V processed steps wrote (a bound: see the cache)
        self.prefilled = False        # its last prompt chunk has been launched
        self.pending = 0
        self.future_id = 0
        self.decode = decode          # the decode policy's record of this request
        self.finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"
        self.error = ""                         # why, when finish_reason is "error"
        self.matched_stop: int | None = None
        self.sent = 0                 # outputs already sent to the front
        self.retractions = 0
        self.exported = False         # prefilled here for a decode node (PrefillExporter.add): its KV leaves

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def known_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def check_finish(self, token: int, context_length: int) -> bool:
        """Set finish_reason if `token` (just appended) ends the request."""
        if token in self.stop_ids:
            self.finish_reason, self.matched_stop = "stop", token
        elif len(self.output_ids) >= self.params.max_new_tokens or self.known_len >= context_length:
            self.finish_reason = "length"
        return self.finish_reason is not None
