"""The target a front gives its rank processes. It imports the rank's code (torch, the model) only
in the rank process itself, so that the front, which never runs a model, starts without torch."""
from __future__ import annotations


def rank_process(args, rank: int, socket_path: str) -> None:
    from engine.rank_main import rank_main
    rank_main(args, rank, socket_path)
