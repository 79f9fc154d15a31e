"""Python's cyclic garbage collector in a serving process. A collection walks the objects the
collector tracks in the generations it collects and holds the process meanwhile: a rank's loop or
the front's event loop stops, and every request waits. A full collection walks them all, and what a
process builds while it starts (modules, the model's Python objects, the tokenizer) lives as long as
the process: walking it at every full collection only stalls. After start-up it goes into the
collector's permanent generation (gc.freeze), which no collection walks. That is not disabling the
collector: what is created later is collected as before (a reference cycle among a finished
request's objects, say), and a frozen object that loses its last reference is still freed.

Some modules come later: a rank's first grammar imports xgrammar and transformers' tokenizer side,
some 1,000 modules and 90,000 objects, which every full collection after it walked (a rank under the
soak's traffic: full collections of 66-177 ms). The grammar compiler freezes them once it is built,
and a rank with nothing to do freezes whatever else was imported since its last freeze
(freeze_new_imports). The requests alive at the compiler's freeze are frozen with it: what they leave
in reference cycles then stays, once, for those few requests; at an idle rank no request is alive.

A full collection of a default server's rank on the embedded model walked some 178,000 objects and
held its loop 60-90 ms; the same collection after the freeze walks what was made since (docs/
reliability.md, "Collector pauses"). The pauses are counted for /metrics, and one that holds the
process longer than WARN_S is logged.

Imports no torch.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Callable

log = logging.getLogger("tandem")

WARN_S = 0.05       # a collection that holds the process longer than this is logged


class CollectorPauses:
    """Watches the collector (gc.callbacks): collections per generation, the seconds they held the
    process, the longest, and how many objects start-up froze."""

    def __init__(self, process: str = "", clock: Callable[[], float] = time.perf_counter):
        self.process = process
        self.clock = clock
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self.longest = 0.0
        self.frozen = 0
        self.modules = 0                 # modules imported when it last froze
        self.started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        # NOTE: runs inside the collection (no collection starts meanwhile); keeps to plain arithmetic
        # but for the rare warning
        if phase == "start":
            self.started = self.clock()
            return
        if self.started is None:
            return
        held, self.started = self.clock() - self.started, None
        self.collections[info["generation"]] += 1
        self.seconds += held
        self.longest = max(self.longest, held)
        if held > WARN_S:
            log.warning("%s: the garbage collector held the process %.0f ms (generation %d, %d objects freed)",
                        self.process, held * 1e3, info["generation"], info["collected"])

    def watch(self) -> CollectorPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def unwatch(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def freeze_startup_objects(self) -> int:
        """Collect what start-up left behind, then take every live object out of later collections;
        returns how many objects the permanent generation holds."""
        gc.collect()
        gc.freeze()
        self.frozen, self.modules = gc.get_freeze_count(), len(sys.modules)
        log.debug("%s: %d start-up objects frozen out of the collector's walks", self.process, self.frozen)
        return self.frozen

    def freeze_new_imports(self) -> bool:
        """Freeze again where modules were imported since the last freeze (a lazy import): from a rank with
        nothing to do (no request's objects alive), and from the grammar compiler once built (the requests
        alive then are frozen too: the module docstring). Its collection runs once a lazy import."""
        if not self.modules or len(sys.modules) <= self.modules:
            return False
        self.freeze_startup_objects()
        return True


PAUSES = CollectorPauses()      # this process's (a rank's tables report it: engine/stats.py process_stats)


def after_startup(process: str) -> CollectorPauses:
    """What a serving process calls once it has started: its start-up frozen (that collection is start-up's,
    not counted), then its pauses watched."""
    PAUSES.process = process
    PAUSES.freeze_startup_objects()
    return PAUSES.watch()
