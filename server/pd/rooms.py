"""Rooms: one request's transfer between a prefill node and a decode node, on either side.

A room's state only moves forward, and each side counts what happened to its rooms:

  bootstrapping -> waiting -> transferring -> done
        \\______________\\_____________\\____> failed (with a reason)

  bootstrapping  decode: KV reserved, a prefill node being picked and asked; prefill: accepted
  waiting        the prefill runs (or waits for its turn in the prefill ranks)
  transferring   KV is moving (the first layer was sent / received)
  done           the decode side has the whole prompt and the first token
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

STATES = ("bootstrapping", "waiting", "transferring", "done", "failed")


@dataclass
class Room:
    room: str
    state: str = "bootstrapping"
    started: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    reason: str = ""


class PdStats:
    """A node's rooms by state, bytes moved, transfer seconds and failures by reason (for /metrics)."""

    def __init__(self, role: str):
        self.role = role
        self.rooms: dict[str, Room] = {}
        self.finished: Counter[str] = Counter()       # done / failed rooms since the start
        self.failures: Counter[str] = Counter()       # failed rooms by reason kind
        self.bytes_total = 0
        self.transfer_seconds = 0.0

    def open(self, room: str) -> Room:
        entry = self.rooms[room] = Room(room)
        return entry

    def advance(self, entry: Room, state: str) -> None:
        """Move a room forward; a state it is past is ignored (states never go back)."""
        if STATES.index(state) > STATES.index(entry.state) and entry.state not in ("done", "failed"):
            entry.state = state

    def moved(self, entry: Room, nbytes: int) -> None:
        self.advance(entry, "transferring")
        entry.bytes += nbytes
        self.bytes_total += nbytes

    def close(self, entry: Room, state: str, reason: str = "") -> None:
        """The room ends: done, or failed with a reason (its first word counts as the kind)."""
        if entry.state in ("done", "failed"):
            return
        entry.state, entry.reason = state, reason
        self.rooms.pop(entry.room, None)
        self.finished[state] += 1
        self.transfer_seconds += time.perf_counter() - entry.started
        if state == "failed":
            self.failures[failure_kind(reason)] += 1

    def by_state(self) -> dict[str, int]:
        live = Counter(room.state for room in self.rooms.values())
        return {state: live.get(state, 0) for state in STATES[:3]}


def failure_kind(reason: str) -> str:
    """A short label for a failure reason: timeout, lost peer, abort, refused, engine, busy."""
    text = reason.lower()
    for kind, words in (("timeout", ("timed out", "timeout", "silent")), ("abort", ("abort",)),
                        ("lost_peer", ("lost", "closed", "reset", "connect")), ("busy", ("busy", "overloaded")),
                        ("bad_data", ("bad", "protocol", "malformed"))):
        if any(word in text for word in words):
            return kind
    return "engine"
