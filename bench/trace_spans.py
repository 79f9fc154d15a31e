"""Summarise rank traces (run.py --trace-file): per track and span kind, the median span, the spans a
run holds and their sum; with several traces per label (LABEL=FILE, repeated), the medians of those.

    python bench/trace_spans.py now=/tmp/now.r1.json now=/tmp/now.r2.json old=/tmp/old.r1.json ...

A trace's step numbers are dropped from span names ("forward 12" counts as "forward"), so that two
code trees serving the same workload can be compared launch by launch: the device's time per launch
and the loop's scheduling, launch and processing spans, which a throughput figure mixes with the
machine's own swings."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.trace import TRACKS as TRACK_IDS  # noqa: E402

STEP = re.compile(r" \d+$")          # a span's step number
TRACKS = {tid: name for name, tid in TRACK_IDS.items()}


def spans(path: Path) -> list[dict]:
    """The complete ("X") events of one trace; a trace cut short by a crash still reads."""
    text = path.read_text().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return [e for e in json.loads(text) if e.get("ph") == "X"]


def summary(events: list[dict]) -> dict[str, tuple[float, int, float]]:
    """(track/kind) -> (median µs, count, sum ms); plus "run/wall": first device start to last end."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for event in events:
        kind = re.sub(STEP, "", event["name"])
        by_kind[f"{TRACKS.get(event['tid'], event['tid'])}/{kind}"].append(event["dur"])
    out = {kind: (statistics.median(durs), len(durs), sum(durs) / 1e3) for kind, durs in by_kind.items()}
    device = [e for e in events if e["tid"] == TRACK_IDS["device"]]
    if device:
        wall = max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)
        out["run/wall"] = (wall, 1, wall / 1e3)
    return out


def table(labelled: dict[str, list[dict[str, tuple[float, int, float]]]]) -> str:
    labels = list(labelled)
    kinds = sorted({kind for runs in labelled.values() for run in runs for kind in run})
    lines = [f"{'track/kind':<24}" + "".join(f"{label + ': median µs, n, sum ms':>40}" for label in labels)]
    for kind in kinds:
        cells = []
        for label in labels:
            rows = [run[kind] for run in labelled[label] if kind in run]
            cells.append("-" if not rows else f"{statistics.median(r[0] for r in rows):10.1f} "
                         f"{statistics.median(r[1] for r in rows):6.0f} {statistics.median(r[2] for r in rows):9.1f}")
        lines.append(f"{kind:<24}" + "".join(f"{cell:>40}" for cell in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", metavar="LABEL=FILE", help="A trace and the label it counts under.")
    args = parser.parse_args(argv)
    labelled: dict[str, list] = defaultdict(list)
    for item in args.traces:
        label, sep, path = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected LABEL=FILE")
        labelled[label].append(summary(spans(Path(path))))
    print(table(labelled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
