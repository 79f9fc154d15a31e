"""An in-process EngineClient for HTTP-layer tests, and the tokenizer those tests use.

FakeEngine answers each request with a fixed script of tokens (or the prompt
reversed), one delta every `token_delay` seconds, honouring max_new_tokens,
EOS, stop_token_ids and ignore_eos. It records every request and every abort,
and can be switched to reject requests, fail mid-way, or be dead.
"""
from __future__ import annotations

import asyncio
from collections import deque
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

from engine.kv_pool import KVPool
from engine.messages import RankStats, SamplingParams, TokenDelta
from engine.scheduler import Scheduler, SchedulerConfig
from engine.trace import OverlapMeter
from spec.stats import SpecStats
from server.detokenizer import byte_level_decoder
from server.engine_client import EngineClient, EngineDead, EngineRejected

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "tandem-dense"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. Hello world, hello there! ",
          "Once upon a time there was a small server that answered every request quickly. ",
          "Numbers 0123456789 and punctuation: ,.;:!?()[]{}<>-_=+*/\\'\" are common too. "]


def rank_stats(rank: int, running: int, waiting: int, kv_used: int, steps: int, hidden_cpu_fraction: float,
               retractions: int, accept_length: int, off_steps: int) -> RankStats:
    """What a rank in that state reports: the tables of real components (a scheduler with 1000 KV slots,
    its overlap meter, speculation whose every verify step emitted `accept_length` tokens)."""
    scheduler = Scheduler(SchedulerConfig(8, 8, 64, 64, 64, 18), KVPool(1000, 1, 8), frozenset())
    holders = [SimpleNamespace(pages=[], cache_path=[]) for _ in range(running)]     # the running requests' pages
    scheduler.running, scheduler.waiting = holders, deque([None] * waiting)
    scheduler.step, scheduler.retractions, scheduler.policy.off_steps = steps, retractions, off_steps
    scheduler.pool.grow(holders[0].pages if holders else [], kv_used)
    meter = OverlapMeter()
    meter.cpu_total, meter.hidden_total = 1.0, hidden_cpu_fraction
    spec = SpecStats(accept_length)
    spec.accept_hist[-1] = 10
    return RankStats(rank, scheduler.stats() + scheduler.pool.stats() + meter.stats() + spec.stats(scheduler.policy))


@lru_cache(maxsize=1)
def build_test_tokenizer():
    """The model's tokenizer when models/tandem-dense exists, else a tiny byte-level BPE with ChatML."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if (MODEL_DIR / "tokenizer_config.json").exists() or (MODEL_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(MODEL_DIR))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (byte-level vocabularies), to split characters across tokens."""
    table = {byte: ch for ch, byte in byte_level_decoder().items()}
    ids = []
    for byte in text.encode("utf-8"):
        tid = tokenizer.convert_tokens_to_ids(table[byte])
        if tid is None or tid == tokenizer.unk_token_id:
            tid = tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>")     # sentencepiece byte fallback
        ids.append(tid)
    return ids


class FakeEngine(EngineClient):
    def __init__(self, tokenizer, token_delay: float = 0.001, tokens_per_delta: int = 1):
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.token_delay, self.tokens_per_delta = token_delay, tokens_per_delta
        self.script: list[int] | None = None        # None: answer with the prompt reversed
        self.reject: Exception | None = None        # raised when a request starts (EngineRejected, or a bug)
        self.fail_after: int | None = None          # raise `failure` after this many tokens
        self.failure: Exception = EngineRejected("the fake engine gave up", 503)
        self.dead = False
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborts: list[tuple[str, str]] = []     # (rid, reason), one per aborted request
        self.active: set[str] = set()
        self._aborted: set[str] = set()
        self.stats = [rank_stats(0, running=2, waiting=1, kv_used=100, steps=50, hidden_cpu_fraction=0.8,
                                 retractions=1, accept_length=2, off_steps=4),
                      rank_stats(1, running=3, waiting=0, kv_used=50, steps=70, hidden_cpu_fraction=0.6,
                                 retractions=0, accept_length=3, off_steps=3)]

    def script_text(self, tokenizer, text: str, eos: bool = True) -> None:
        self.script = tokenizer.encode(text, add_special_tokens=False) + ([self.eos_id] if eos else [])

    def _output(self, input_ids: list[int]) -> list[int]:
        return list(self.script) if self.script else list(reversed(input_ids))

    def _logprobs(self, tokens: list[int], k: int | None):
        if k is None:
            return None, None
        top = [[(t, -0.25)] + [((t + j) % self.vocab_size, -1.0 - j) for j in range(1, k)] for t in tokens]
        return [-0.25] * len(tokens), [row[:k] for row in top]

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams):
        if self.dead:
            raise EngineDead("the fake engine is dead")
        if self.reject is not None:
            raise self.reject
        self.requests.append((rid, list(input_ids), params))
        self.active.add(rid)
        script, produced, finished = self._output(input_ids), 0, False
        try:
            while True:
                await asyncio.sleep(self.token_delay)
                if rid in self._aborted:
                    finished = True
                    yield TokenDelta(rid, [], finish_reason="abort", completion_tokens=produced)
                    return
                if self.fail_after is not None and produced >= self.fail_after:
                    finished = True
                    raise self.failure
                tokens, finish, matched = [], None, None
                while len(tokens) < self.tokens_per_delta and finish is None:
                    tok = script[produced % len(script)]
                    tokens.append(tok)
                    produced += 1
                    if (tok == self.eos_id and not params.ignore_eos) or tok in params.stop_token_ids:
                        finish, matched = "stop", tok
                    elif produced >= params.max_new_tokens:
                        finish = "length"
                logprobs, top = self._logprobs(tokens, params.logprobs)
                finished = finish is not None
                yield TokenDelta(rid, tokens, logprobs=logprobs, top_logprobs=top, finish_reason=finish,
                                 matched_stop=matched, prompt_tokens=len(input_ids), completion_tokens=produced)
                if finished:
                    return
        finally:
            self.active.discard(rid)
            if not finished and rid not in self._aborted:
                self._aborted.add(rid)
                self.aborts.append((rid, "abort"))     # closed or cancelled before the end

    async def abort(self, rid: str, reason: str = "abort") -> None:
        if rid in self.active and rid not in self._aborted:
            self._aborted.add(rid)
            self.aborts.append((rid, reason))

    def is_healthy(self) -> bool:
        return not self.dead

    def rank_stats(self) -> list[RankStats]:
        return list(self.stats)

    async def close(self) -> None:
        self.dead = True
