"""Typed messages between the front (server/) and a rank process (engine/).

One union per direction. Frames on the unix socket are msgpack-encoded, tagged
msgspec Structs (see engine/framing.py). Every message names its request id `rid`.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engine.wire_tensor import WireTensor

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class GrammarSpec(msgspec.Struct, frozen=True):
    """What a request's output must match (structured outputs, engine/grammar.py): a JSON schema
    (`strict`: no properties or items beyond the schema's), any JSON value (json_object), a regex or
    an EBNF grammar, as source text."""
    kind: Literal["json_schema", "json_object", "regex", "ebnf"]
    source: str = ""
    strict: bool = True


class SamplingParams(msgspec.Struct, frozen=True):
    max_new_tokens: int = 128
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None         # per-request generator: same seed, same output
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None     # None: none; 0: the chosen token's; k>0: also the top k
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


# ---- front -> rank -------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    # "unified": prefill and decode here; "prefill": prefill only, exporting the KV and the first
    # token (a prefill node); "decode": reserve KV and wait for them from a prefill node
    mode: str = "unified"


class KvLayer(msgspec.Struct, tag=True):
    """Prefill/decode: K and V of positions [start, start + count) of one layer of a request: data is
    [2, count, kv_heads, head_dim]. The same message goes rank -> front -> decode node -> rank."""
    rid: str
    start: NonNegative
    count: NonNegative
    layer: NonNegative
    kind: Literal["target", "draft"]    # the target's cache, or the draft model's (or head's) own
    data: WireTensor


class PrefillDone(msgspec.Struct, tag=True):
    """Prefill/decode: the prompt is in the KV sent before; the first token, and what the decode
    side's speculative worker (draft_row) and decode policy (record) need to go on."""
    rid: str
    kv_len: NonNegative
    first_token: NonNegative
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    draft_row: dict[str, WireTensor] = {}
    record: dict = {}


class AbortRequest(msgspec.Struct, tag=True):
    rid: str
    reason: str = "abort"           # "abort" (client gone) or "stop" (the front matched a stop string)


class Shutdown(msgspec.Struct, tag=True):
    pass


class Wake(msgspec.Struct, tag=True):
    """DP attention: another rank of the group has work; exchange with the group now."""


class FlushCache(msgspec.Struct, tag=True):
    """Empty the prefix cache (refused while requests run: their pages are in use)."""
    nonce: int


ToRank = AddRequest | AbortRequest | Shutdown | KvLayer | PrefillDone | Wake | FlushCache


# ---- rank -> front -------------------------------------------------------------

class TokenDelta(msgspec.Struct, tag=True):
    """New output tokens of one request (an accepted speculative run may bring several)."""
    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None                          # one per token
    top_logprobs: list[list[tuple[int, float]]] | None = None    # per token: (id, logprob), best first
    finish_reason: str | None = None   # None while running; "stop" | "length" | "abort"
    matched_stop: int | None = None    # the EOS / stop token id that finished it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    cached_tokens: int = 0


class RequestRejected(msgspec.Struct, tag=True):
    rid: str
    message: str
    status: int = 400


class RequestFailed(msgspec.Struct, tag=True):
    """The engine ended the request because its batch failed; its resources are freed."""
    rid: str
    message: str


class PrefillReserved(msgspec.Struct, tag=True):
    """Decode side: KV for the prompt and one decode step is reserved; its prefill may start."""
    rid: str


class Sample(msgspec.Struct, frozen=True, array_like=True):
    """One value of a metric: for a histogram, its bucket's count (not cumulative) under the bucket's upper bound."""
    labels: tuple[str, ...]         # () for a metric without labels
    value: float


class Stat(msgspec.Struct, frozen=True):
    """One metric of a rank, as the component that keeps it describes it (engine/stats.py makes them)."""
    name: str                       # as /metrics serves it (Prometheus adds "_total" to a counter's)
    kind: str                       # "counter", "gauge" or "histogram"
    help: str
    combine: str                    # over ranks: "sum", "mean" or "mean_measured" (engine/stats.py)
    samples: list[Sample]
    label_names: tuple[str, ...] = ()       # a histogram's: ("le",)
    observed_sum: float = 0.0       # a histogram's sum of observations

    @property
    def total(self) -> float:
        """The sum of its samples: its value without labels; a histogram's count of observations."""
        return sum(sample.value for sample in self.samples)


class RankStats(msgspec.Struct, tag=True):
    """Periodic statistics of a rank, for /metrics and tests: the tables of its components, one after another."""
    rank: int
    stats: list[Stat]

    def value(self, name: str) -> float:
        """The total of the metric named `name` (Stat.total); 0 where the rank does not report it."""
        return sum(stat.total for stat in self.stats if stat.name == name)


class RankReady(msgspec.Struct, tag=True):
    """First message of a rank once its model is loaded and its KV cache allocated."""
    rank: int
    kv_total: int
    context_length: int
    description: str
    dtype: str                      # the dtype the model runs in, resolved ("float32", not "auto")
    kv_dtype: str = ""              # the dtype of its KV cache ("": as dtype)
    draft_weights: str | None = None    # the draft model's quantization, resolved (None: unquantized or no draft)


class CacheFlushed(msgspec.Struct, tag=True):
    """A rank's answer to FlushCache: refused (with why) or done."""
    nonce: int
    refused: str = ""


FromRank = (TokenDelta | RequestRejected | RequestFailed | RankStats | RankReady | KvLayer | PrefillDone
            | PrefillReserved | CacheFlushed)
