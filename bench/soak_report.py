"""What bench/soak.py keeps while it runs (outcomes, violations, latencies, kill events) and the
JSON summary it prints at the end.
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from bench.soak_checks import Answer, Plan
from bench.soak_server import RssSample

EXAMPLES_PER_KIND = 5


# ---- what the run keeps -------------------------------------------------------------------

@dataclass
class KillEvent:
    number: int
    pid: int
    at_s: float                         # since the start of the run
    ranks_before: int
    recovered_s: float | None = None    # until /health answered 200 with every rank back
    unhealthy_s: float = 0.0            # how long /health answered anything else
    outcome: str = "watching"           # recovered | rank_not_restarted | no_recovery | server_exited


@dataclass
class Record:
    start_s: float
    end_s: float
    outcome: str


class Tally:
    """Outcomes by request kind, violations by kind with a few examples, allowed failures, latencies."""

    def __init__(self):
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.violations: Counter = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.clear_failures: list[str] = []
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.ttft: dict[str, list[float]] = defaultdict(list)
        self.records: list[Record] = []

    def violation(self, kind: str, detail: str) -> None:
        self.violations[kind] += 1
        if len(self.examples[kind]) < EXAMPLES_PER_KIND:
            self.examples[kind].append(detail)

    def add(self, plan: Plan, answer: Answer, outcome: str, violations: list, note: str, t0: float) -> None:
        self.outcomes[plan.kind][outcome] += 1
        for kind, detail in violations:
            self.violation(kind, f"request {plan.index} ({plan.kind}): {detail}")
        if outcome == "failed_clear" and len(self.clear_failures) < EXAMPLES_PER_KIND:
            self.clear_failures.append(f"request {plan.index} ({plan.kind}): {note}")
        if outcome == "ok":
            self.latency[plan.kind].append(answer.end - answer.start)
            if answer.ttft is not None:
                self.ttft[plan.kind].append(answer.ttft)
        self.records.append(Record(answer.start - t0, answer.end - t0, outcome))


def per_kind_ms(values: dict[str, list[float]], reduce) -> dict[str, float]:
    return {kind: round(1000 * reduce(v), 1) for kind, v in sorted(values.items()) if v}


def rss_growth(samples: list[RssSample], basis: str) -> float | None:
    """Percent growth from the sample after the second tenth (past the warm-up) to the last one."""
    if len(samples) < 3 or not getattr(samples[1], basis):
        return None
    first, last = getattr(samples[1], basis), getattr(samples[-1], basis)
    return round(100.0 * (last - first) / first, 2)


# ---- the summary --------------------------------------------------------------------------

def summarize(soak, duration_s: float) -> dict:
    tally = soak.tally
    by_outcome = sum(tally.outcomes.values(), Counter())
    return {
        "config": config_record(soak.args),
        "server_pid": soak.server_pid,
        "duration_s": round(duration_s, 1),
        "stopped_early": soak.stop_reason,
        "requests": {"sent": soak.done, "by_outcome": dict(sorted(by_outcome.items())),
                     "by_kind": {kind: dict(sorted(c.items())) for kind, c in sorted(tally.outcomes.items())}},
        "violations": {"total": sum(tally.violations.values()),
                       "by_kind": {kind: {"count": count, "examples": tally.examples[kind]}
                                   for kind, count in sorted(tally.violations.items())}},
        "allowed_failures": {"count": by_outcome["failed_clear"], "examples": tally.clear_failures},
        "determinism": soak.determinism.stats(),
        "latency_ms": {"median_e2e": per_kind_ms(tally.latency, statistics.median),
                       "max_e2e": per_kind_ms(tally.latency, max),
                       "median_ttft": per_kind_ms(tally.ttft, statistics.median)},
        "memory": memory_report(soak),
        "end_state": soak.end_state,
        "kv_pages": soak.pages.report(),
        "kills": kill_report(soak) if soak.args.kill_rank_every else None,
    }


def memory_report(soak) -> dict:
    basis = soak.rss_basis()
    samples = [{"requests": s.requests, "elapsed_s": s.elapsed_s, "front_mb": round(s.front_bytes / 2**20, 1),
                "ranks_mb": round(s.ranks_bytes / 2**20, 1), "source": s.source} for s in soak.rss]
    return {"source": soak.rss[0].source if soak.rss else None, "basis": basis,
            "growth_pct": rss_growth(soak.rss, basis), "max_growth_pct": soak.args.max_rss_growth,
            "samples": samples}


def kill_report(soak) -> dict:
    """Kill events, and failures sorted by whether they overlapped a kill's window (kill to recovery)."""
    windows = [(e.at_s, e.at_s + (e.recovered_s if e.recovered_s is not None else soak.args.recovery_timeout))
               for e in soak.kills]

    def near(record: Record) -> bool:
        return any(record.start_s <= end and record.end_s >= start for start, end in windows)

    counts = Counter((r.outcome, near(r)) for r in soak.tally.records if r.outcome in ("failed_clear", "violation"))
    return {"events": [asdict(e) for e in soak.kills],
            "failed_clear_near_kills": counts["failed_clear", True],
            "failed_clear_elsewhere": counts["failed_clear", False],
            "violations_near_kills": counts["violation", True], "violations_elsewhere": counts["violation", False]}


def config_record(args) -> dict:
    """The arguments as JSON values, without the API key."""
    skip = {"headers", "api_key"}
    return {k: v for k, v in vars(args).items()
            if k not in skip and isinstance(v, (str, int, float, bool, list, type(None)))}
