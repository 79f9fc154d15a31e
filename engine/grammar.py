"""Structured outputs: a request's grammar (a JSON schema, any JSON, a regex, EBNF) compiled by
xgrammar, and the matcher that says which tokens may come next.

Who touches a request's matcher, and when:
  the rank's loop   makes it once the grammar is compiled (off the loop, GrammarCompiler) and, on a
                    decode node, feeds it the prefill node's first token: all before the request's
                    first batch is launched;
  the stream        from then on, alone (engine/grammar_masks.py): a step masks a constrained row's
                    logits by its matcher, samples, and leaves the sampled token pending; the next step
                    that needs the matcher accepts it first. A speculative verify walks the matcher
                    along the chain and rolls back past what it rejects.
Steps run on the stream in launch order, so a matcher always holds exactly the tokens its request
has emitted, without a lock; a step whose outputs are voided never ran, so it accepted nothing. The
loop never waits for a matcher: it ends a request on the grammar's stop token, which it sees.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.gc_pause import PAUSES
from engine.messages import GrammarSpec

log = logging.getLogger(__name__)

CACHE_ENTRIES = 128       # compiled grammars kept (most recently used), keyed by their spec
COMPILE_THREADS = 2       # xgrammar's threads for one compile: the model's threads keep the rest
JSON_OBJECT = '{"type": "object"}'
XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")     # "[14:05:09] /project/cpp/x.cc:94: " before a reason


class GrammarError(ValueError):
    """A grammar xgrammar refuses; the message names the problem (the request gets a 400)."""


def refusal(exc: Exception) -> GrammarError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return GrammarError(XGRAMMAR_PREFIX.sub("", text))


def parse_grammar(spec: GrammarSpec) -> None:
    """Check a grammar's source without a tokenizer (fast: the front's check before it queues a request).
    Raises GrammarError."""
    import xgrammar as xgr
    try:
        if spec.kind in ("json_schema", "json_object"):
            xgr.Grammar.from_json_schema(json_source(spec), **json_options(spec))
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise refusal(exc) from None


def json_source(spec: GrammarSpec) -> str:
    """The schema of a JSON grammar: json_object is any object. JSON comes without free whitespace
    (", " and ": " between items): a model's preference for newlines cannot run an answer to its
    length limit inside the whitespace that JSON allows."""
    return spec.source if spec.kind == "json_schema" else JSON_OBJECT


def json_options(spec: GrammarSpec) -> dict:
    return {"strict_mode": spec.strict and spec.kind == "json_schema", "any_whitespace": False}


class GrammarCompiler:
    """A rank's compiler: grammars compiled against the model's tokenizer in a thread of their own
    (xgrammar releases the GIL: the loop runs on), the most recent CACHE_ENTRIES kept by spec."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_ids: frozenset[int]):
        self.tokenizer_path, self.vocab_size, self.stop_ids = tokenizer_path, vocab_size, sorted(stop_ids)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.compiler = None            # made on the first grammar: loads the tokenizer
        self.compiled = 0               # compilations done (cache misses)

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (or of a GrammarError). Call from the loop only."""
        done = self.cache.get(spec)
        if done is not None:
            self.cache.move_to_end(spec)
            future: Future = Future()
            future.set_result(done)
            return future
        return self.executor.submit(self.compile_now, spec)

    def keep(self, spec: GrammarSpec, compiled: Any) -> None:
        """Remember a compiled grammar (from the loop, when its future is done)."""
        self.cache[spec] = compiled
        self.cache.move_to_end(spec)
        while len(self.cache) > CACHE_ENTRIES:
            self.cache.popitem(last=False)

    def compile_now(self, spec: GrammarSpec) -> Any:
        """In the compile thread."""
        compiler = self.compiler or self.make_compiler()
        try:
            self.compiled += 1
            if spec.kind in ("json_schema", "json_object"):
                return compiler.compile_json_schema(json_source(spec), **json_options(spec))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            return compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise refusal(exc) from None

    def make_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        PAUSES.freeze_new_imports()          # engine/gc_pause.py: the modules it took out of later collections
        return self.compiler

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Grammar:
    """A request's matcher (see the module docstring for who may touch it)."""

    def __init__(self, compiled: Any):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.stop_ids = frozenset(self.matcher.stop_token_ids)
        self.pending: tuple[Any, int] | None = None     # (tokens tensor, index): sampled, not yet accepted

    @property
    def ended(self) -> bool:
        """It accepted a stop token: the request ends there (later steps' tokens are dropped)."""
        return self.matcher.is_terminated()

    def settle(self) -> None:
        """Accept the token the last step sampled (a host read of it: free on the CPU)."""
        if self.pending is not None:
            tokens, index = self.pending
            self.pending = None
            self.accept(int(tokens[index]))

    def accept(self, token: int) -> bool:
        if self.ended:
            return False                  # a step past the request's end (overlap): its token is dropped
        if self.matcher.accept_token(token):
            return True
        log.warning("a grammar refused token %d that its own mask allowed", token)
        return False

    def try_draft(self, token: int) -> bool:
        """Walk a speculative draft (refused: the chain is cut there)."""
        return not self.ended and self.matcher.accept_token(token)

    def fill(self, bitmask, index: int) -> None:
        """Row `index` of the bitmask: the tokens that may come next (every token past the end: the
        step's token for this request is dropped)."""
        if self.ended:
            bitmask[index].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)

    def rollback(self, count: int) -> None:
        if count > 0:
            self.matcher.rollback(count)
