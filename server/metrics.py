"""Prometheus metrics of the HTTP front, in a registry of its own.

Request outcomes (`tandem_requests_total{outcome}`), counted once per HTTP
generation request:
  ok        the response was completed
  abort     the client went away before the end
  rejected  refused before generating: invalid input, or the engine refused it (e.g. overload)
  error     the engine died or failed mid-way, or the server hit a bug
Token counters and latency histograms are per engine request (one per choice):
prompt tokens are counted when the first output arrives, generated tokens as they arrive.
The ranks' statistics are read from `engine.rank_stats()` at scrape time.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.messages import RankStats, Stat
from engine.stats import COUNTER, GAUGE, HISTOGRAM, MEAN, MEAN_MEASURED, SUM
from server.engine_client import EngineClient

OUTCOMES = ("ok", "error", "abort", "rejected")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class RankStatsCollector(Collector):
    """The ranks' statistics: each metric of their components' tables, combined over the ranks as its
    entry says (engine/stats.py). It names none of them: a component's new table needs no edit here."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        yield GaugeMetricFamily("tandem_ranks_up", "Rank processes running and connected.",
                                value=self.engine.ranks_up())
        yield CounterMetricFamily("tandem_rank_restarts", "Rank processes restarted after they died.",
                                  value=self.engine.restarts)
        for entries in by_name(self.engine.rank_stats()).values():
            family = metric_family(entries)
            if family is not None:
                yield family


class PdCollector(Collector):
    """Prefill/decode transfers of this node (nothing on a unified node)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        stats = self.engine.pd_stats
        if stats is None:
            return
        rooms = GaugeMetricFamily("tandem_pd_rooms", "Transfers in flight by state.", labels=["state"])
        for state, count in stats.by_state().items():
            rooms.add_metric([state], count)
        yield rooms
        finished = CounterMetricFamily("tandem_pd_rooms_finished", "Transfers ended, done or failed.",
                                       labels=["state"])
        for state in ("done", "failed"):
            finished.add_metric([state], stats.finished.get(state, 0))
        yield finished
        failures = CounterMetricFamily("tandem_pd_failures", "Failed transfers by reason.", labels=["reason"])
        for reason, count in sorted(stats.failures.items()):
            failures.add_metric([reason], count)
        yield failures
        yield CounterMetricFamily("tandem_pd_transferred_bytes", "KV bytes moved between the nodes.",
                                  value=stats.bytes_total)
        yield CounterMetricFamily("tandem_pd_transfer_seconds", "Seconds from a transfer's start to its end, summed.",
                                  value=stats.transfer_seconds)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mean_measured(values: list[float]) -> float:
    """0 means not measured yet."""
    return mean([value for value in values if value > 0] or [0.0])


FAMILIES = {COUNTER: CounterMetricFamily, GAUGE: GaugeMetricFamily}
COMBINE = {SUM: sum, MEAN: mean, MEAN_MEASURED: mean_measured}


def by_name(ranks: list[RankStats]) -> dict[str, list[Stat]]:
    """Every rank's entry of each metric, in the order the ranks report them."""
    entries: dict[str, list[Stat]] = {}
    for rank in ranks:
        for stat in rank.stats:
            entries.setdefault(stat.name, []).append(stat)
    return entries


def by_labels(entries: list[Stat]) -> dict[tuple[str, ...], list[float]]:
    """Each sample's values over the ranks that report it."""
    values: dict[tuple[str, ...], list[float]] = {}
    for stat in entries:
        for sample in stat.samples:
            values.setdefault(sample.labels, []).append(sample.value)
    return values


def metric_family(entries: list[Stat]):
    """One metric over the ranks, described by the first rank's entry (None: labelled, and no rank has a sample)."""
    first, values = entries[0], by_labels(entries)
    if first.kind == HISTOGRAM:
        return histogram_family(first, values, sum(stat.observed_sum for stat in entries))
    if first.label_names and not values:
        return None
    family = FAMILIES[first.kind](first.name, first.help, labels=list(first.label_names))
    for labels, per_rank in values.items():
        family.add_metric(list(labels), COMBINE[first.combine](per_rank))
    return family


def histogram_family(first: Stat, counts: dict[tuple[str, ...], list[float]], observed_sum: float):
    """Counts per bucket, summed over the ranks and added up into cumulative buckets."""
    buckets, running = [], 0.0
    for (bound,), per_rank in sorted(counts.items(), key=lambda item: float(item[0][0])):
        running += sum(per_rank)
        buckets.append((bound, running))
    buckets.append(("+Inf", running))
    return HistogramMetricFamily(first.name, first.help, buckets=buckets, sum_value=observed_sum)


class Metrics:
    """Counters and histograms the handlers update, plus the scrape-time rank gauges."""

    def __init__(self, engine: EngineClient):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("tandem_requests", "HTTP generation requests by outcome.", ["outcome"], registry=reg)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of engine requests that produced output.",
                                     registry=reg)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated.", registry=reg)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Arrival to the end of the response.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        reg.register(RankStatsCollector(engine))
        reg.register(PdCollector(engine))
        ProcessCollector(registry=reg)          # process_resident_memory_bytes etc. of the front

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Times one HTTP request and records its outcome exactly once."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.outcome: str | None = None

    def finish(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.e2e.observe(time.perf_counter() - self.start)
