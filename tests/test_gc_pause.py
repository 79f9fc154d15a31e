"""The garbage collector in a serving process (engine/gc_pause.py): start-up objects frozen out of its
walks, what is made later still collected, its pauses counted and the long ones logged; a real
server's rank reports them on /metrics."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
import types
import weakref

import aiohttp

from engine import grammar
from engine.gc_pause import WARN_S, CollectorPauses
from tests.server_harness import REPO, metric, running_server


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_objects_leave_the_collector_s_walks_and_later_cycles_are_still_collected():
    pauses = CollectorPauses("test")
    before = Cycle()
    try:
        frozen = pauses.freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > 0 and pauses.frozen == frozen
        assert not any(obj is before for obj in gc.get_objects())       # frozen: no collection walks it
        later = Cycle()
        gone = weakref.ref(later)
        del later
        assert gone() is not None                # a cycle: only the collector frees it
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
    assert any(obj is before for obj in gc.get_objects())


def test_what_a_lazy_import_brings_is_frozen_once_the_process_is_idle():
    pauses = CollectorPauses("test")
    try:
        pauses.freeze_startup_objects()
        assert not pauses.freeze_new_imports()              # nothing imported since
        made_by_the_import = Cycle()
        sys.modules["tandem_test_lazy_module"] = types.ModuleType("tandem_test_lazy_module")
        assert pauses.freeze_new_imports()
        assert not any(obj is made_by_the_import for obj in gc.get_objects())
        assert not pauses.freeze_new_imports()              # once per import
    finally:
        sys.modules.pop("tandem_test_lazy_module", None)
        gc.unfreeze()


def test_the_grammar_compiler_freezes_what_it_imported(monkeypatch):
    """A rank under load never idles: the compiler's modules (xgrammar, the tokenizer's) are frozen as it is
    built."""
    pauses = CollectorPauses("test")
    monkeypatch.setattr(grammar, "PAUSES", pauses)
    config = json.loads((REPO / "models" / "tandem-dense" / "config.json").read_text())
    compiler = grammar.GrammarCompiler(str(REPO / "models" / "tandem-dense"), config["vocab_size"], frozenset({2}))
    try:
        pauses.freeze_startup_objects()
        before = pauses.modules
        sys.modules["tandem_test_lazy_module"] = types.ModuleType("tandem_test_lazy_module")   # were all imported
        compiler.make_compiler()
        assert pauses.modules > before
    finally:
        sys.modules.pop("tandem_test_lazy_module", None)
        compiler.close()
        gc.unfreeze()


def test_pauses_are_counted_by_generation_and_a_long_one_is_logged(caplog):
    now = [0.0]
    pauses = CollectorPauses("rank 0", clock=lambda: now[0])
    pauses("start", {"generation": 0, "collected": 0})
    now[0] += 0.002
    pauses("stop", {"generation": 0, "collected": 3})
    with caplog.at_level(logging.WARNING, logger="tandem"):
        pauses("start", {"generation": 2, "collected": 0})
        now[0] += 2 * WARN_S
        pauses("stop", {"generation": 2, "collected": 7})
    assert pauses.collections == [1, 0, 1]
    assert abs(pauses.seconds - (0.002 + 2 * WARN_S)) < 1e-9 and pauses.longest == 2 * WARN_S
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0: the garbage collector held the process 100 ms (generation 2, 7 objects freed)"]
    pauses("stop", {"generation": 1, "collected": 0})       # a stop without its start (watching began mid-way)
    assert pauses.collections == [1, 0, 1]


def test_watching_a_real_collection_counts_it():
    pauses = CollectorPauses("test").watch()
    try:
        gc.collect()
    finally:
        pauses.unwatch()
    assert pauses.collections[2] == 1 and pauses.seconds > 0
    gc.collect()
    assert pauses.collections[2] == 1


def test_a_server_s_rank_freezes_its_start_up_and_what_its_first_grammar_imports(tmp_path):
    """The rank freezes its start-up; its first grammar imports the compiler's modules, which it freezes
    once it has nothing to do; its pauses are on /metrics."""
    async def run(url: str) -> tuple[str, str]:
        async with aiohttp.ClientSession() as session:
            async def complete(**extra) -> None:
                body = {"model": "tandem-dense", "prompt": "hello " * 8, "max_tokens": 8, **extra}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            async def metrics() -> str:
                async with session.get(url + "/metrics") as resp:
                    return await resp.text()
            await complete()
            await asyncio.sleep(1.5)                   # the rank's next report
            before = await metrics()
            await complete(response_format={"type": "json_object"})
            deadline = time.monotonic() + 30
            after = await metrics()
            while (metric(after, "tandem_rank_gc_frozen_objects") == metric(before, "tandem_rank_gc_frozen_objects")
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.5)
                after = await metrics()
            return before, after

    with running_server(["--speculative-algorithm", "none"], tmp_path / "server.log") as srv:
        before, after = asyncio.run(run(srv.url))
    assert metric(before, "tandem_rank_gc_frozen_objects") > 10_000         # the model's, torch's, the tokenizer's
    assert metric(after, "tandem_rank_gc_frozen_objects") > metric(before, "tandem_rank_gc_frozen_objects") + 10_000
    assert metric(after, "tandem_rank_gc_pause_seconds_total") >= 0          # served (counted: the tests above)
    assert metric(after, "tandem_rank_gc_full_collections_total") >= 0
