"""The KV pool's pages as the server reports them, for bench/soak.py, on plain data.

Every page of the pool is in exactly one place: the free list, the prefix cache, or a running
request's own pages (engine/kv_pool.py). The server counts each place apart (the free list's
length, the cache's pages, the requests' own pages: `tandem_kv_slots_owned`), so a page lost or
in two places shows as three gauges that do not add up to `tandem_kv_slots_total`. Once the
server has drained, no request owns a page and none reads a cached one.

`PageWatch` checks that on the gauges during the run and at its end, and reports how the prefix
cache did over the run (hit rate, evictions) and how many requests were retracted for lack of KV
space (a retracted request recomputes), from the counters at the start and the end.
"""
from __future__ import annotations

TOTAL, FREE, CACHED, IDLE, OWNED = ("tandem_kv_slots_total", "tandem_kv_slots_free", "tandem_prefix_cache_tokens",
                                    "tandem_prefix_cache_idle_tokens", "tandem_kv_slots_owned")
PLACES = (TOTAL, FREE, CACHED, IDLE, OWNED)
RUN_COUNTERS = {"prompt_tokens": "tandem_prefix_cache_prompt_tokens_total",
                "hit_tokens": "tandem_prefix_cache_hit_tokens_total",
                "evicted_tokens": "tandem_prefix_cache_evicted_tokens_total",
                "retractions": "tandem_retractions_total"}


def page_problems(gauges: dict[str, float], drained: bool) -> list[str]:
    """What does not add up in the pool's slots (gauges holding PLACES), drained or mid-run."""
    total, free, cached, idle, owned = (gauges[name] for name in PLACES)
    problems = []
    if free + cached + owned != total:
        problems.append(f"free {free:g} + cached {cached:g} + requests' own {owned:g} = "
                        f"{free + cached + owned:g}, not the {total:g} slots of the pool")
    if drained and (owned or cached != idle):
        problems.append(f"drained, yet requests own {owned:g} slots and read {cached - idle:g} cached ones")
    return problems


class PageWatch:
    """Checks the pool's accounting whenever asked; violations go to the soak's tally."""

    def __init__(self, tally):
        self.tally = tally
        self.checks = self.unmeasured = 0
        self.counters_at_start: dict[str, float] | None = None
        self.at_end: dict[str, float] | None = None

    def begin(self, gauges: dict[str, float] | None) -> None:
        """The counters before the run (the server may have served before it)."""
        if gauges is not None and all(name in gauges for name in RUN_COUNTERS.values()):
            self.counters_at_start = {key: gauges[name] for key, name in RUN_COUNTERS.items()}

    def check(self, gauges: dict[str, float] | None, when: str, drained: bool = False) -> None:
        if gauges is None or not all(name in gauges for name in PLACES):
            self.unmeasured += 1            # no /metrics, or a server that does not count its pages apart
            return
        self.checks += 1
        for problem in page_problems(gauges, drained):
            self.tally.violation("kv_pages_mismatch", f"{when}: {problem}")
        if drained:
            self.at_end = gauges

    def report(self) -> dict:
        end = self.at_end
        pages = None if end is None else {"total": end[TOTAL], "free": end[FREE], "cached": end[CACHED],
                                          "owned": end[OWNED]}
        run = self.over_the_run()
        cache = None if run is None else {
            "prompt_tokens": run["prompt_tokens"], "hit_tokens": run["hit_tokens"],
            "hit_rate": round(run["hit_tokens"] / run["prompt_tokens"], 4) if run["prompt_tokens"] else 0.0,
            "evicted_tokens": run["evicted_tokens"], "cached_at_end": end[CACHED]}
        return {"checks": self.checks, "unmeasured": self.unmeasured, "slots_at_end": pages,
                "prefix_cache": cache, "retractions": None if run is None else run["retractions"]}

    def over_the_run(self) -> dict[str, float] | None:
        """Each counter's growth from the start to the end (None where either is unknown)."""
        end, start = self.at_end, self.counters_at_start
        if end is None or start is None or not all(name in end for name in RUN_COUNTERS.values()):
            return None
        return {key: end[name] - start[key] for key, name in RUN_COUNTERS.items()}
