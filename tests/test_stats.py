"""A rank's statistics: each component describes its metrics in a table (engine/stats.py), the rank
sends them all in one RankStats, and /metrics (server/metrics.py) merges the ranks' entries by name,
naming none of them."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from engine.core import EngineCore
from engine.dp import DpCounters
from engine.kv_pool import KVPool
from engine.messages import FromRank, RankStats
from engine.policy import PlainDecoding
from engine.rank import Rank, component_tables
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stats import GAUGE, MEAN, counter, gauge, per_label
from server.metrics import RankStatsCollector
from spec.gate import Estimate
from spec.policy import SpeculativeDecoding
from spec.stats import SpecStats

# What /metrics served of the ranks before their statistics were per-component tables (commit 3d92127,
# a rank speculating with the adaptive gate on): name -> (type, help). Every one is still served as it was.
SERVED_BEFORE = {
    "tandem_ranks_up": ("gauge", "Rank processes running and connected."),
    "tandem_rank_restarts_total": ("counter", "Rank processes restarted after they died."),
    "tandem_failed_steps_total": (
        "counter", "Launched steps that failed; only their requests got errors (since the ranks started)."),
    "tandem_rank_resident_memory_bytes": ("gauge", "Resident memory of the rank processes."),
    "tandem_dp_idle_steps_total": (
        "counter", "DP attention: steps ranks ran with no rows, to keep in step with their group."),
    "tandem_dp_padding_tokens_total": ("counter", "DP attention: rows the MoE exchange padded to the group's largest."),
    "tandem_dp_sync_seconds_total": (
        "counter", "DP attention: seconds ranks spent in the per-step exchange (summed over ranks)."),
    "tandem_dp_exchanges_total": (
        "counter", "DP attention: per-step exchanges, idle polling included (summed over ranks)."),
    "tandem_dp_steps_total": ("counter", "DP attention: steps run, idle ones included (summed over ranks)."),
    "tandem_graph_replays_total": ("counter", "Captured steps (target and draft) replayed."),
    "tandem_graph_padded_rows_total": (
        "counter", "Rows of graph replays that no request owned (batches padded to a captured size)."),
    "tandem_spec_off_steps_total": (
        "counter", "Decode steps that ran without speculation because as many requests decoded as "
        "--speculative-disable-by-batch-size."),
    "tandem_spec_gate_plain_steps_total": (
        "counter", "Decode steps that ran without speculation because the adaptive gate expected it to lose at "
        "their batch size (--speculative-adaptive)."),
    "tandem_spec_gate_explorations_total": (
        "counter", "Decode launches the adaptive gate ran in the mode it did not choose, to keep measuring it."),
    "tandem_num_running_reqs": ("gauge", "Requests decoding now."),
    "tandem_num_waiting_reqs": ("gauge", "Requests waiting for admission."),
    "tandem_kv_slots_used": ("gauge", "KV cache slots in use."),
    "tandem_kv_slots_total": ("gauge", "KV cache slots in all."),
    "tandem_steps_total": ("gauge", "Scheduler steps run so far."),
    "tandem_hidden_cpu_fraction": (
        "gauge", "Share of CPU scheduling time hidden behind device work (mean over ranks)."),
    "tandem_retractions_total": ("gauge", "Requests retracted for lack of KV space so far."),
    "tandem_spec_accept_length": ("gauge", "Mean accepted tokens per speculative verify step (mean over ranks)."),
    "tandem_spec_accept_length_per_step": ("histogram", "Tokens emitted per speculative verify step."),
    "tandem_spec_phase_seconds_total": ("counter", "Device seconds spent per speculative phase."),
    "tandem_spec_gate_tokens_per_second": (
        "gauge", "Expected decode tokens/s of a request, by batch size and mode, from the device time and accepted "
        "tokens measured so far."),
    "tandem_spec_gate_speculating": (
        "gauge", "1 where the adaptive gate speculates at this batch size, 0 where it decodes plainly (share of "
        "ranks)."),
}
ADDED_SINCE = {
    "tandem_graph_idle_replays_total": (
        "counter", "DP attention: target graphs replayed with padding only (the rank had no batch)."),
    "tandem_kv_slots_free": ("gauge", "KV cache slots on the free list."),
    "tandem_prefix_cache_prompt_tokens_total": ("counter", "Prompt tokens of requests admitted (recomputes included)."),
    "tandem_prefix_cache_hit_tokens_total": ("counter", "Of those, tokens read from the prefix cache."),
    "tandem_prefix_cache_hit_rate": ("gauge", "Share of prompt tokens read from the prefix cache since start (mean "
                                     "over the ranks that admitted any)."),
    "tandem_prefix_cache_tokens": ("gauge", "Tokens the prefix cache holds."),
    "tandem_prefix_cache_idle_tokens": ("gauge", "Of those, tokens no running request reads (free to evict)."),
    "tandem_prefix_cache_evicted_tokens_total": ("counter", "Tokens evicted from the prefix cache."),
    "tandem_kv_slots_owned": ("gauge", "KV cache slots in pages that requests hold as their own (not the cached "
                              "pages they read): with the free and the cached ones, every slot."),
    "tandem_rank_gc_pause_seconds_total": ("counter", "Seconds the garbage collector held the rank processes."),
    "tandem_rank_gc_full_collections_total": ("counter", "Full (generation 2) collections of the rank processes."),
    "tandem_rank_gc_frozen_objects": ("gauge", "Start-up objects the rank processes froze out of the collector's "
                                      "walks."),
}


class GateSaid:
    """A gate that has explored `explorations` times and estimates `estimates`."""

    def __init__(self, explorations: int, estimates: list[Estimate]):
        self.explorations, self.said = explorations, estimates

    def estimates(self) -> list[Estimate]:
        return self.said


class Runner:
    """The model runner's part in the statistics: its graph runners (devices/graphs.py) and target graphs."""

    def __init__(self, replays: int = 0, padded_rows: int = 0, idle_replays: int | None = None):
        self.runners = [SimpleNamespace(replays=Counter({4: replays}), padded_rows=padded_rows)]
        self.graphs = None if idle_replays is None else SimpleNamespace(idle_replays=idle_replays)

    def graph_runners(self) -> list:
        return self.runners


def a_rank(rank: int, *, running: int = 0, accept_hist: tuple[int, ...] = (), gate=None, dp: DpCounters | None = None,
           runner: Runner | None = None, more_tables: tuple = ()) -> RankStats:
    """What Rank.stats reports for a rank whose components are in this state, as the front receives it."""
    scheduler = Scheduler(SchedulerConfig(8, 8, 64, 64, 64, 18), KVPool(100, 1, 8), frozenset(),
                          SpeculativeDecoding(len(accept_hist) or 1, gate=gate))
    scheduler.running = [SimpleNamespace(pages=[], cache_path=[])] * running
    spec = SpecStats(len(accept_hist))
    spec.accept_hist = list(accept_hist)
    core = EngineCore(scheduler, runner or Runner(), overlap=True)
    ranked = Rank.__new__(Rank)          # its statistics only: no model, no channel
    ranked.rank = rank
    ranked.stat_tables = component_tables(core, spec, dp and SimpleNamespace(counters=dp)) + list(more_tables)
    wire = msgspec.msgpack.Decoder(FromRank)
    return wire.decode(msgspec.msgpack.encode(ranked.stats()))


def served(ranks: list[RankStats]) -> str:
    """The rank part of /metrics."""
    registry = CollectorRegistry()
    registry.register(RankStatsCollector(SimpleNamespace(rank_stats=lambda: ranks, ranks_up=lambda: len(ranks),
                                                         restarts=0)))
    return generate_latest(registry).decode()


def descriptions(text: str) -> dict[str, tuple[str, str]]:
    """name -> (type, help) from the # HELP and # TYPE lines."""
    helps = {line.split(" ", 3)[2]: line.split(" ", 3)[3] for line in text.splitlines() if line.startswith("# HELP")}
    types = {line.split(" ")[2]: line.split(" ")[3] for line in text.splitlines() if line.startswith("# TYPE")}
    assert helps.keys() == types.keys()
    return {name: (types[name], helps[name]) for name in helps}


def values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_metric_served_before_the_tables_keeps_its_name_type_and_help():
    gate = GateSaid(2, [Estimate("1", 800.0, 1000.0, False)])
    text = served([a_rank(0, accept_hist=(1, 2, 3, 0, 4), gate=gate), a_rank(1)])
    assert descriptions(text) == SERVED_BEFORE | ADDED_SINCE


def test_ranks_combine_as_each_entry_says():
    gates = [GateSaid(1, [Estimate("1", 800.0, 1000.0, False), Estimate("2-3", 900.0, 0.0, True)]),
             GateSaid(2, [Estimate("1", 700.0, 0.0, True)])]
    ranks = [a_rank(0, running=2, accept_hist=(1, 0, 2), gate=gates[0], dp=DpCounters(idle_steps=3),
                    runner=Runner(replays=5, padded_rows=7, idle_replays=2)),
             a_rank(1, running=3, accept_hist=(0, 3, 0, 0, 1), gate=gates[1], runner=Runner(replays=1))]
    m = values(served(ranks))
    assert m["tandem_num_running_reqs"] == 5 and m["tandem_kv_slots_total"] == 200          # summed
    assert m["tandem_spec_accept_length"] == (7 / 3 + 11 / 4) / 2                          # mean over ranks
    # accept lengths 1 x1, 2 x3, 3 x2, 5 x1: cumulative buckets over both ranks' widths
    assert [m[f'tandem_spec_accept_length_per_step_bucket{{le="{le}"}}'] for le in ("1.0", "2.0", "3.0", "4.0", "5.0",
                                                                                      "+Inf")] == [1, 4, 6, 6, 7, 7]
    assert m["tandem_spec_accept_length_per_step_count"] == 7 and m["tandem_spec_accept_length_per_step_sum"] == 18
    assert m["tandem_spec_gate_explorations_total"] == 3
    assert m['tandem_spec_gate_tokens_per_second{batch_size="1",mode="speculative"}'] == 750
    assert m['tandem_spec_gate_tokens_per_second{batch_size="1",mode="plain"}'] == 1000     # mean of those measured
    assert m['tandem_spec_gate_tokens_per_second{batch_size="2-3",mode="plain"}'] == 0      # measured by none
    assert m['tandem_spec_gate_speculating{batch_size="1"}'] == 0.5                        # share of ranks
    assert m['tandem_spec_gate_speculating{batch_size="2-3"}'] == 1                        # of those reporting it
    assert m["tandem_dp_idle_steps_total"] == 3 and m["tandem_graph_idle_replays_total"] == 2
    assert m["tandem_graph_replays_total"] == 6 and m["tandem_graph_padded_rows_total"] == 7


def test_without_speculation_the_histogram_is_empty_and_the_gate_has_no_estimates():
    text = served([a_rank(0)])
    assert values(text)['tandem_spec_accept_length_per_step_bucket{le="+Inf"}'] == 0
    assert "tandem_spec_gate_tokens_per_second" not in text and "tandem_spec_gate_speculating" not in text
    assert values(text)["tandem_spec_gate_explorations_total"] == 0


class Widgets:
    """A component /metrics has never heard of."""

    def __init__(self, made: int, blue_share: float, by_colour: dict[str, int]):
        self.made, self.blue_share, self.by_colour = made, blue_share, by_colour

    def stats(self):
        return [counter("tandem_test_widgets", "Widgets made.", self.made),
                gauge("tandem_test_widgets_blue_share", "Share of widgets that are blue (mean over ranks).",
                      self.blue_share, MEAN),
                per_label(GAUGE, "tandem_test_widgets_now", "Widgets now, by colour.", ("colour",),
                          {(colour,): count for colour, count in self.by_colour.items()})]


def test_a_new_components_table_reaches_metrics_without_an_edit_there():
    ranks = [a_rank(0, more_tables=(Widgets(3, 0.25, {"blue": 1, "red": 2}).stats,)),
             a_rank(1, more_tables=(Widgets(4, 0.75, {"blue": 5}).stats,))]
    assert ranks[0].value("tandem_test_widgets") == 3 and ranks[0].value("tandem_test_widgets_now") == 3
    text = served(ranks)
    assert descriptions(text)["tandem_test_widgets_total"] == ("counter", "Widgets made.")
    assert descriptions(text)["tandem_test_widgets_now"] == ("gauge", "Widgets now, by colour.")
    m = values(text)
    assert m["tandem_test_widgets_total"] == 7 and m["tandem_test_widgets_blue_share"] == 0.5
    assert m['tandem_test_widgets_now{colour="blue"}'] == 6 and m['tandem_test_widgets_now{colour="red"}'] == 2
    assert m["tandem_num_running_reqs"] == 0          # the components' own tables beside it


def test_the_rank_log_line_says_what_speculation_did():
    spec, policy = SpecStats(3), SpeculativeDecoding(3)
    spec.accept_hist = [1, 0, 1]
    assert spec.log_text(policy) == ", accept length 2.00"
    policy.off_steps, policy.gate_steps = 4, 2
    assert spec.log_text(policy) == ", accept length 2.00, speculation off for 4 steps (load), plain for 2 steps (gate)"
    assert SpecStats(0).log_text(PlainDecoding()) == ""          # no speculation: nothing to say
