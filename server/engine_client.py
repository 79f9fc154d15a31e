"""What the HTTP front needs from the engine: submit a tokenized request, stream
its TokenDeltas, abort it, and read health and rank gauges.

`RankEngineClient` (server/rank_client.py) implements it over unix sockets to
the rank processes; tests may implement it in-process.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator

from engine.messages import RankStats, SamplingParams, TokenDelta


class EngineRejected(Exception):
    """The engine refused the request (bad input it could only see itself, or overload)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineDead(Exception):
    """The rank process serving the request is gone; the request cannot finish."""


class EngineClient(ABC):
    @abstractmethod
    def generate(self, rid: str, input_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield TokenDeltas for one request; the last one has finish_reason set.
        Raises EngineRejected / EngineDead. Closing the iterator (or cancelling the task
        consuming it) before the last delta aborts the request in the engine."""

    @abstractmethod
    async def abort(self, rid: str, reason: str = "abort") -> None:
        """Stop a request; reason "stop" when the front matched a stop string."""

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once any rank process has died."""

    @abstractmethod
    def rank_stats(self) -> list[RankStats]:
        """The latest gauges from each rank."""

    @abstractmethod
    async def close(self) -> None:
        """Shut the ranks down."""
