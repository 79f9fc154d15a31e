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
    """The rank process serving the request is gone (or the server is shutting down); the request
    cannot finish. HTTP 503."""


class EngineFailed(Exception):
    """The engine hit an error while running this request's batch; the request was ended and
    its resources freed, and the engine goes on serving the others. HTTP 500."""


class EngineClient(ABC):
    @abstractmethod
    def generate(self, rid: str, input_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield TokenDeltas for one request; the last one has finish_reason set.
        Raises EngineRejected / EngineDead / EngineFailed. Closing the iterator (or cancelling the task
        consuming it) before the last delta aborts the request in the engine."""

    @abstractmethod
    async def abort(self, rid: str, reason: str = "abort") -> None:
        """Stop a request; reason "stop" when the front matched a stop string."""

    @abstractmethod
    def is_healthy(self) -> bool:
        """True while requests can be served: some rank is up and the server is not stopping."""

    @abstractmethod
    def rank_stats(self) -> list[RankStats]:
        """The latest gauges from each rank that is up."""

    restarts = 0        # rank processes restarted after they died
    pd_stats = None     # prefill/decode: the node's rooms and transfers (server/pd/rooms.py: PdStats)

    def ranks_up(self) -> int:
        """Rank processes serving now."""
        return len(self.rank_stats())

    async def flush_cache(self) -> str:
        """Empty the prefix cache; why not, or "" when done."""
        return "this engine has no prefix cache"

    @abstractmethod
    async def close(self) -> None:
        """Shut the ranks down."""
