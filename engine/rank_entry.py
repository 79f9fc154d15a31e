"""The target a front gives its rank processes, and what the two sides agree on besides their
messages: the rank's exit codes and the heartbeats of ranks on other hosts. It imports the rank's
code (torch, the model) only in the rank process itself, so that the front, which never runs a
model, starts without torch."""
from __future__ import annotations

# How a rank process ends (besides 0: told to stop by a Shutdown, and 1: an unexpected error):
EXIT_ENGINE_BROKEN = 3     # steps kept failing: the device is suspect
EXIT_GROUP_BROKEN = 4      # a collective of its DP-attention group failed: another rank is gone
EXIT_FRONT_LOST = 5        # its link to the front broke (closed, reset, silent) before a Shutdown
EXIT_REFUSED = 6           # the front refused it (another model or flags): starting it again cannot help
EXIT_MEANINGS = {EXIT_ENGINE_BROKEN: "its steps kept failing", EXIT_GROUP_BROKEN: "its DP group broke",
                 EXIT_FRONT_LOST: "its link to the front broke", EXIT_REFUSED: "the front refused it"}

# Seconds between heartbeats on the TCP link of a rank of another host (local ranks, on a unix
# socket, are supervised by their process instead): a peer silent for three of them (15 s) is gone.
# Below the DP group's collective timeout (engine/dp.py, 30 s), so that the front names the silent
# rank before the others fail with a broken group. A long device step does not silence a rank: its
# Pings are answered by the reader task on its loop, which a step does not hold (the CPU stream runs
# in a worker thread; accelerator launches are queued, a full launch queue holding the loop for
# less than the step, and their events are awaited from a helper thread; the group's per-step
# exchange runs in a thread). Heartbeats start once RankReady is sent, after the model load and
# graph capture that do hold the loop.
RANK_HEARTBEAT_INTERVAL_S = 5.0


def rank_process(args, rank: int, socket_path: str) -> None:
    from engine.rank_main import rank_main
    rank_main(args, rank, socket_path)
