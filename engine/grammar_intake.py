"""A rank's intake of constrained requests: each waits, outside the scheduler, for its grammar to
compile (in the compiler's thread: a large schema never stalls the loop or other requests), then
joins the scheduler with its matcher; a grammar xgrammar refuses rejects the request with a 400.

An abort while compiling forgets the request (nothing of it is in the scheduler yet); the compiled
grammar is still kept for the next request that sends it.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from engine.grammar import Grammar, GrammarCompiler, GrammarError
from engine.messages import AddRequest
from engine.stats import Stat, counter, gauge

log = logging.getLogger(__name__)


@dataclass
class Compiled:
    """A request whose grammar compiled (grammar) or was refused (error)."""
    msg: AddRequest
    grammar: Grammar | None = None
    error: str = ""


def back_on(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """From the compile thread: run callback on the loop, unless the rank has stopped (its loop is closed)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


class GrammarIntake:
    def __init__(self, compiler: GrammarCompiler, limit: int, deliver: Callable[[Compiled], None]):
        self.compiler, self.limit, self.deliver = compiler, limit, deliver
        self.compiling: dict[str, AddRequest] = {}
        self.requests = 0            # constrained requests taken in
        self.refused = 0             # of them, rejected for their grammar

    def start(self, msg: AddRequest) -> Compiled | None:
        """Compile msg's grammar: the result now where it is cached, else None and `deliver` later
        (on the loop). Raises OverflowError when too many requests are compiling."""
        if len(self.compiling) >= self.limit:
            raise OverflowError("overloaded")
        self.requests += 1
        future = self.compiler.compile(msg.params.grammar)
        if future.done():
            return self.compiled(msg, future)
        self.compiling[msg.rid] = msg
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda f: back_on(loop, self.finish, msg, f))
        return None

    def finish(self, msg: AddRequest, future: Future) -> None:
        if self.compiling.get(msg.rid) is not msg:
            self.keep(msg, future)
            return                                   # aborted while compiling
        del self.compiling[msg.rid]
        self.deliver(self.compiled(msg, future))

    def keep(self, msg: AddRequest, future: Future) -> None:
        if future.exception() is None:
            self.compiler.keep(msg.params.grammar, future.result())

    def compiled(self, msg: AddRequest, future: Future) -> Compiled:
        try:
            compiled = future.result()
        except GrammarError as exc:
            self.refused += 1
            return Compiled(msg, error=f"the grammar cannot be compiled: {exc}")
        except Exception as exc:        # noqa: BLE001 (an xgrammar failure of one grammar fails one request)
            log.exception("compiling the grammar of %s failed", msg.rid)
            self.refused += 1
            return Compiled(msg, error=f"the grammar cannot be compiled: {type(exc).__name__}: {exc}")
        self.compiler.keep(msg.params.grammar, compiled)
        return Compiled(msg, grammar=Grammar(compiled))

    def abort(self, rid: str) -> bool:
        """Forget a request still compiling; False: it is not compiling."""
        return self.compiling.pop(rid, None) is not None

    def stats(self) -> list[Stat]:
        return [counter("tandem_grammar_requests_total", "Requests with a grammar (structured outputs).",
                        self.requests),
                counter("tandem_grammar_refused_total", "Requests rejected for a grammar that does not compile.",
                        self.refused),
                counter("tandem_grammar_compilations_total", "Grammars compiled (requests whose grammar was "
                        "not in the cache).", self.compiler.compiled),
                gauge("tandem_grammar_compiling", "Requests waiting for their grammar to compile.",
                      len(self.compiling))]

    def close(self) -> None:
        self.compiler.close()
