"""How a component describes its metrics: a table of Stats (engine/messages.py), made where its
counters live, e.g. the KV pool's:

    def stats(self) -> list[Stat]:
        return [gauge("tandem_kv_slots_used", "KV cache slots in use.", self.used_slots), ...]

A rank sends the tables of all its components in one RankStats (engine/rank.py: component_tables);
the front (server/metrics.py) merges the ranks' entries by name and serves each as its entry says,
naming none of them: a new component's metrics reach /metrics without an edit there.

How the ranks' values of a sample combine:

    sum            summed over the ranks (counts, seconds, slots)
    mean           the mean over the ranks that report the sample (shares, lengths)
    mean_measured  the mean over the ranks whose value is not 0 (0: not measured yet); 0 where none is

Pure Python: scheduling code builds its tables with it.
"""
from __future__ import annotations

import os

from engine.messages import Sample, Stat

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
SUM, MEAN, MEAN_MEASURED = "sum", "mean", "mean_measured"


def counter(name: str, text: str, value: float) -> Stat:
    """A count since the rank started, summed over ranks (served as `name`_total)."""
    return Stat(name, COUNTER, text, SUM, [Sample((), float(value))])


def gauge(name: str, text: str, value: float, combine: str = SUM) -> Stat:
    return Stat(name, GAUGE, text, combine, [Sample((), float(value))])


def per_label(kind: str, name: str, text: str, label_names: tuple[str, ...],
              values: dict[tuple[str, ...], float], combine: str = SUM) -> Stat:
    """A counter or gauge with a value per label values (`values`: label values -> value)."""
    samples = [Sample(labels, float(value)) for labels, value in values.items()]
    return Stat(name, kind, text, combine, samples, label_names)


def histogram(name: str, text: str, counts: dict[float, int], observed_sum: float) -> Stat:
    """Observations counted per bucket (`counts`: upper bound -> observations in that bucket alone),
    summed over ranks; /metrics adds them up into Prometheus' cumulative buckets."""
    samples = [Sample((str(float(bound)),), float(count)) for bound, count in counts.items()]
    return Stat(name, HISTOGRAM, text, SUM, samples, ("le",), float(observed_sum))


def process_stats() -> list[Stat]:
    """The rank process's own footprint, and what its garbage collector held it for (engine/gc_pause.py)."""
    from engine.gc_pause import PAUSES
    return [gauge("tandem_rank_resident_memory_bytes", "Resident memory of the rank processes.",
                  resident_memory_bytes()),
            counter("tandem_rank_gc_pause_seconds", "Seconds the garbage collector held the rank processes.",
                    PAUSES.seconds),
            counter("tandem_rank_gc_full_collections", "Full (generation 2) collections of the rank processes.",
                    PAUSES.collections[2]),
            gauge("tandem_rank_gc_frozen_objects", "Start-up objects the rank processes froze out of the "
                  "collector's walks.", PAUSES.frozen)]


def resident_memory_bytes() -> int:
    """This process's RSS, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def graph_stats(runners: list, idle_replays: int) -> list[Stat]:
    """The graph runners' replays (devices/graphs.py: GraphRunner; target and draft), and the target
    graphs' replays of padding only (engine/target_graphs.py)."""
    return [counter("tandem_graph_replays", "Captured steps (target and draft) replayed.",
                    sum(sum(runner.replays.values()) for runner in runners)),
            counter("tandem_graph_padded_rows", "Rows of graph replays that no request owned (batches padded to a "
                    "captured size).", sum(runner.padded_rows for runner in runners)),
            counter("tandem_graph_idle_replays", "DP attention: target graphs replayed with padding only (the rank "
                    "had no batch).", idle_replays)]
