"""A host other than node 0 of a DP-attention group (--nnodes > 1, --node-rank > 0): it runs its share
of the group's ranks, which connect to node 0's front over TCP, and no HTTP front of its own.

If one of its ranks dies the group is broken: the others end too (GroupBroken), node 0's front
restarts its own ranks, and this host starts its share again, as often as --max-rank-restarts
allows within 10 minutes; beyond that it exits non-zero for its supervisor to take over. A rank
that ends with code 0 was told to stop (the front shut down): then this host stops too. A rank the
front refused (its model or flags differ from node 0's, the reason is in both logs) is not started
again either: this host exits non-zero at once.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal

from engine.args import ServerArgs
from engine.rank_entry import EXIT_REFUSED, rank_process
from server.rank_client import RESTART_WINDOW_S, describe_exit, remote_rank_address

log = logging.getLogger("tandem")
POLL_S = 0.2


async def serve_remote_ranks(args: ServerArgs) -> int:
    per_node = args.dp_size // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    host, port = remote_rank_address(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    deaths: list[float] = []
    while True:
        processes = start(args, ranks, f"tcp://{host}:{port}")
        log.info("node %d: ranks %s started; they join node 0's front at %s:%d", args.node_rank,
                 list(ranks), host, port)
        code = await watch(processes, stop)
        end(processes)
        if code is None or code == 0:
            return 0
        if code == EXIT_REFUSED:
            log.error("node %d: node 0's front refused this host's ranks (see the reason above); not "
                      "starting them again", args.node_rank)
            return 1
        now = loop.time()
        deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(deaths) > args.max_rank_restarts:
            log.error("node %d: %d group failures within 10 minutes; giving up", args.node_rank, len(deaths))
            return 1
        log.warning("node %d: a rank ended (%s); starting this host's ranks again", args.node_rank,
                    describe_exit(code))


def start(args: ServerArgs, ranks: range, address: str) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=rank_process, args=(args, rank, address), name=f"tandem-rank{rank}", daemon=True)
                 for rank in ranks]
    for process in processes:
        process.start()
    return processes


async def watch(processes: list[mp.Process], stop: asyncio.Event) -> int | None:
    """The exit code of the first rank to end (None: this host was told to stop)."""
    while not stop.is_set():
        for process in processes:
            if not process.is_alive():
                process.join(1)
                return process.exitcode
        await asyncio.sleep(POLL_S)
    return None


def end(processes: list[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(5)
