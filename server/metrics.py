"""Prometheus metrics of the HTTP front, in a registry of its own.

Request outcomes (`tandem_requests_total{outcome}`), counted once per HTTP
generation request:
  ok        the response was completed
  abort     the client went away before the end
  rejected  refused before generating: invalid input, or the engine refused it (e.g. overload)
  error     the engine died or failed mid-way, or the server hit a bug
Token counters and latency histograms are per engine request (one per choice):
prompt tokens are counted when the first output arrives, generated tokens as they arrive.
Rank gauges are read from `engine.rank_stats()` at scrape time.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from server.engine_client import EngineClient

OUTCOMES = ("ok", "error", "abort", "rejected")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class RankStatsCollector(Collector):
    """Engine gauges, summed over ranks (CPU fraction and accept length: mean over ranks)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        stats = list(self.engine.rank_stats())
        def total(field: str) -> float:
            return float(sum(getattr(s, field) for s in stats))

        def mean(field: str) -> float:
            return total(field) / len(stats) if stats else 0.0
        gauges = [
            ("tandem_num_running_reqs", "Requests decoding now.", total("running")),
            ("tandem_num_waiting_reqs", "Requests waiting for admission.", total("waiting")),
            ("tandem_kv_slots_used", "KV cache slots in use.", total("kv_used")),
            ("tandem_kv_slots_total", "KV cache slots in all.", total("kv_total")),
            ("tandem_steps_total", "Scheduler steps run so far.", total("steps")),
            ("tandem_hidden_cpu_fraction", "Share of CPU scheduling time hidden behind device work (mean over ranks).",
             mean("hidden_cpu_fraction")),
            ("tandem_retractions_total", "Requests retracted for lack of KV space so far.", total("retractions")),
            ("tandem_spec_accept_length", "Mean accepted tokens per speculative verify step (mean over ranks).",
             mean("spec_accept_len")),
        ]
        yield GaugeMetricFamily("tandem_ranks_up", "Rank processes running and connected.",
                                value=self.engine.ranks_up())
        yield CounterMetricFamily("tandem_rank_restarts", "Rank processes restarted after they died.",
                                  value=self.engine.restarts)
        yield CounterMetricFamily("tandem_failed_steps", "Launched steps that failed; only their requests got "
                                  "errors (since the ranks started).", value=total("failed_steps"))
        yield GaugeMetricFamily("tandem_rank_resident_memory_bytes", "Resident memory of the rank processes.",
                                value=total("resident_memory_bytes"))
        yield CounterMetricFamily("tandem_dp_idle_steps", "DP attention: steps ranks ran with no rows, to keep "
                                  "in step with their group.", value=total("dp_idle_steps"))
        yield CounterMetricFamily("tandem_dp_padding_tokens", "DP attention: rows the MoE exchange padded to the "
                                  "group's largest.", value=total("dp_padding_tokens"))
        yield CounterMetricFamily("tandem_dp_sync_seconds", "DP attention: seconds ranks spent in the per-step "
                                  "exchange (summed over ranks).", value=total("dp_sync_seconds"))
        yield CounterMetricFamily("tandem_dp_exchanges", "DP attention: per-step exchanges, idle polling included "
                                  "(summed over ranks).", value=total("dp_exchanges"))
        yield CounterMetricFamily("tandem_dp_steps", "DP attention: steps run, idle ones included (summed over ranks).",
                                  value=total("dp_steps"))
        yield CounterMetricFamily("tandem_graph_replays", "Captured steps (target and draft) replayed.",
                                  value=total("graph_replays"))
        yield CounterMetricFamily("tandem_graph_padded_rows", "Rows of graph replays that no request owned (batches "
                                  "padded to a captured size).", value=total("graph_padded_rows"))
        yield CounterMetricFamily("tandem_spec_off_steps", "Decode steps that ran without speculation because as many "
                                  "requests decoded as --speculative-disable-by-batch-size.",
                                  value=total("spec_off_steps"))
        yield CounterMetricFamily("tandem_spec_gate_plain_steps", "Decode steps that ran without speculation because "
                                  "the adaptive gate expected it to lose at their batch size (--speculative-adaptive).",
                                  value=total("spec_gate_steps"))
        yield CounterMetricFamily("tandem_spec_gate_explorations", "Decode launches the adaptive gate ran in the mode "
                                  "it did not choose, to keep measuring it.", value=total("spec_gate_explorations"))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield from spec_metrics(stats)
        yield from gate_metrics(stats)


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


def spec_metrics(stats):
    """Accept-length histogram and draft/verify/extend device time, summed over ranks."""
    width = max((len(s.spec_accept_hist) for s in stats), default=0)
    counts = [sum(s.spec_accept_hist[i] for s in stats if i < len(s.spec_accept_hist)) for i in range(width)]
    buckets, running = [], 0
    for i, count in enumerate(counts):
        running += count
        buckets.append((str(float(i + 1)), running))
    buckets.append(("+Inf", running))
    total = float(sum((i + 1) * c for i, c in enumerate(counts)))
    yield HistogramMetricFamily("tandem_spec_accept_length_per_step", "Tokens emitted per speculative verify step.",
                                buckets=buckets, sum_value=total)
    phases = CounterMetricFamily("tandem_spec_phase_seconds", "Device seconds spent per speculative phase.",
                                 labels=["phase"])
    for phase in ("draft", "verify", "extend"):
        phases.add_metric([phase], sum(s.spec_phase_seconds.get(phase, 0.0) for s in stats))
    yield phases


def gate_metrics(stats):
    """The adaptive gate's estimates per batch-size bucket: a request's expected decode tokens/s
    speculating and plain (mean over the ranks that measured it), and the share of ranks whose
    bucket speculates. Nothing when the gate is off."""
    by_bucket: dict[str, list] = {}
    for s in stats:
        for estimate in s.spec_gate:
            by_bucket.setdefault(estimate.batch_size, []).append(estimate)
    rates = GaugeMetricFamily("tandem_spec_gate_tokens_per_second", "Expected decode tokens/s of a request, by batch "
                              "size and mode, from the device time and accepted tokens measured so far.",
                              labels=["batch_size", "mode"])
    speculating = GaugeMetricFamily("tandem_spec_gate_speculating", "1 where the adaptive gate speculates at this "
                                    "batch size, 0 where it decodes plainly (share of ranks).", labels=["batch_size"])
    for bucket, estimates in by_bucket.items():
        for mode, field in (("speculative", "spec_tokens_per_s"), ("plain", "plain_tokens_per_s")):
            measured = [getattr(e, field) for e in estimates if getattr(e, field) > 0]
            rates.add_metric([bucket, mode], sum(measured) / len(measured) if measured else 0.0)
        speculating.add_metric([bucket], sum(e.speculating for e in estimates) / len(estimates))
    if by_bucket:
        yield rates
        yield speculating


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
