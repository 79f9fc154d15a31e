"""Chrome trace (Perfetto-compatible) of a rank: one track each for CPU scheduling,
launch, device execution and result processing, so the overlap can be seen."""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

from engine.stats import MEAN, Stat, gauge

TRACKS = {"schedule": 1, "launch": 2, "device": 3, "process": 4, "transfer": 5}


class Tracer:
    """Appends complete ("X") events to a JSON array file; a trace cut short by a crash
    still opens (the format tolerates a missing closing bracket)."""

    def __init__(self, path: str | None, rank: int):
        self.rank = rank
        self.file = None
        self.lock = threading.Lock()
        if path:
            root, ext = os.path.splitext(path)
            self.file = open(path if rank == 0 else f"{root}.rank{rank}{ext}", "w")
            self.file.write("[\n")
            for name, tid in TRACKS.items():
                self.write({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})

    @property
    def enabled(self) -> bool:
        return self.file is not None

    def write(self, event: dict) -> None:
        with self.lock:
            self.file.write(json.dumps(event) + ",\n")

    def span(self, track: str, name: str, start: float, end: float, **args) -> None:
        if self.file:
            self.write({"name": name, "ph": "X", "pid": self.rank, "tid": TRACKS[track],
                        "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args})

    @contextmanager
    def timed(self, track: str, name: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(track, name, start, time.perf_counter(), **args)

    def close(self) -> None:
        if self.file:
            with self.lock:
                self.file.write('{"name": "end", "ph": "i", "pid": %d, "tid": 1, "ts": %f, "s": "g"}\n]\n'
                                % (self.rank, time.perf_counter() * 1e6))
                self.file.close()
                self.file = None


class OverlapMeter:
    """Share of CPU scheduling/processing time spent while the device was busy.

    The stream is in order, so once batch k's busy interval [s, f] is known, every CPU
    span that ended before f has met all the device intervals it ever will."""

    def __init__(self):
        self.open_spans: list[list[float]] = []    # [start, end, hidden]
        self.cpu_total = 0.0
        self.hidden_total = 0.0

    def cpu(self, start: float, end: float) -> None:
        self.open_spans.append([start, end, 0.0])

    def device(self, start: float, end: float) -> None:
        still_open = []
        for span in self.open_spans:
            span[2] += max(0.0, min(span[1], end) - max(span[0], start))
            if span[1] <= end:
                self.cpu_total += span[1] - span[0]
                self.hidden_total += span[2]
            else:
                still_open.append(span)
        self.open_spans = still_open

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_total / self.cpu_total if self.cpu_total > 0 else 0.0

    def stats(self) -> list[Stat]:
        return [gauge("tandem_hidden_cpu_fraction", "Share of CPU scheduling time hidden behind device work (mean "
                      "over ranks).", self.hidden_fraction, MEAN)]
