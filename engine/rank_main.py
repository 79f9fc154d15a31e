"""Entry point of a rank process: its own uvloop, the model, and the rank loop, connected to the
front over a unix socket (or TCP, for a rank of another host)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

import torch

from devices.base import create_device
from engine.args import ServerArgs
from engine.messages import RankReady, ToRank
from engine.models.loader import read_target_config
from engine.core import EngineBroken
from engine.dp import DpGroup, GroupBroken
from engine.event_loop import exit_now, run_main
from engine.fingerprint import rank_fingerprint
from engine.framing import Connection, Refusal
from engine.gc_pause import after_startup
from engine.handshake import handshake, load_secret
from engine.rank import Rank
from engine.rank_entry import (EXIT_ENGINE_BROKEN, EXIT_FRONT_LOST, EXIT_GROUP_BROKEN, EXIT_REFUSED,
                               RANK_HEARTBEAT_INTERVAL_S)

log = logging.getLogger(__name__)
TERM_GRACE_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 60.0      # a rank of another host waits this long for node 0's front to listen
CONNECT_RETRY_S = 0.5


def eos_token_ids(model_path: str, config) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    gen_config = Path(model_path) / "generation_config.json"
    if gen_config.exists():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(i) for i in src)
    return frozenset(ids)


async def connect_front(address: str, secret: bytes | None, fingerprint: str) -> Connection:
    """The front's socket: a unix path, or tcp://HOST:PORT (ranks on another host, with heartbeats);
    the handshake compares the fingerprints and proves the --rank-secret when there is one."""
    heartbeat = None
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        reader, writer = await open_tcp(host, int(port))
        heartbeat = RANK_HEARTBEAT_INTERVAL_S
    else:
        reader, writer = await asyncio.open_unix_connection(address)
    conn = Connection(reader, writer, ToRank, kind="rank", heartbeat_interval=heartbeat)
    await handshake(conn, "rank", fingerprint, secret, HANDSHAKE_TIMEOUT_S)
    return conn


async def open_tcp(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, retrying for CONNECT_TIMEOUT_S while nothing listens: this host may start before node 0."""
    deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise ConnectionError(f"node 0's front at {host}:{port} took no connection within "
                                      f"{CONNECT_TIMEOUT_S:g} s: {exc}") from None
            await asyncio.sleep(CONNECT_RETRY_S)


async def join_front(args: ServerArgs, rank: int, address: str) -> Connection:
    """The link to the front, or SystemExit: refused (another model or flags: not worth a restart), or
    no front to connect to."""
    try:
        return await connect_front(address, load_secret(args.rank_secret, "--rank-secret"), rank_fingerprint(args))
    except Refusal as exc:
        log.error("rank %d: the front refused this rank: %s", rank, exc.reason)
        raise SystemExit(EXIT_REFUSED) from None
    except (ConnectionError, asyncio.TimeoutError) as exc:
        log.error("rank %d: no link to the front: %s", rank, exc)
        raise SystemExit(EXIT_FRONT_LOST) from None


async def serve_rank(args: ServerArgs, rank: int, socket_path: str) -> None:
    device = create_device(args.device, rank % (args.dp_size // args.nnodes))
    device.set_threads(cpu_threads(args))
    # NOTE: the handshake before the group: a rank the front refuses never joins its collectives
    channel = await join_front(args, rank, socket_path)
    dp = DpGroup(rank, args.dp_size, args.dist_init_addr, device.collective_backend, device.torch_device) \
        if args.enable_dp_attention else None
    # eos ids come from the checkpoint's own config files
    config = read_target_config(args.model_path)
    worker = Rank(args, rank, device, channel, eos_token_ids(args.model_path, config), dp)
    # SIGTERM (a process-group kill, say): the front drives the shutdown; stop anyway if it never does
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.call_later(args.shutdown_timeout + TERM_GRACE_S, worker.stop))
    after_startup(f"rank {rank}")             # engine/gc_pause.py: start-up out of the collector's walks
    await channel.send(rank_ready(args, rank, device, worker))
    try:
        await worker.run()
    except EngineBroken as exc:
        log.error("rank %d: %s; exiting so that the front starts a new rank", rank, exc)
        raise SystemExit(EXIT_ENGINE_BROKEN) from None
    except GroupBroken as exc:
        log.error("rank %d: %s; exiting so that the front restarts the group", rank, exc)
        raise SystemExit(EXIT_GROUP_BROKEN) from None
    finally:
        device.close()
        channel.close("the rank stopped")
        if dp is not None:
            dp.close()
    if worker.front_lost is not None:
        refused = isinstance(worker.front_lost, Refusal)
        log.error("rank %d: %s (%s); exiting", rank, "the front refused it" if refused else
                  "its link to the front broke", worker.front_lost)
        raise SystemExit(EXIT_REFUSED if refused else EXIT_FRONT_LOST)


def rank_ready(args: ServerArgs, rank: int, device, worker: Rank) -> RankReady:
    return RankReady(rank=rank, kv_total=worker.pool.total_slots, context_length=worker.runner.context_length,
                     description=f"{Path(args.model_path).name} on {device.torch_device}",
                     dtype=str(worker.runner.dtype).removeprefix("torch."),
                     kv_dtype=str(worker.runner.target.kv.k[0].dtype).removeprefix("torch."),
                     draft_weights=getattr(worker.runner.decoding, "draft_weights", None))


def cpu_threads(args: ServerArgs) -> int:
    """Intra-op threads of the CPU stream (the worker thread that runs the model)."""
    return args.cpu_threads or max(1, (os.cpu_count() or 1) // (args.dp_size // args.nnodes))


def rank_main(args: ServerArgs, rank: int, socket_path: str) -> None:
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole group; the front stops the ranks
    torch.set_num_threads(1)           # the loop's own torch calls; the CPU stream sets its threads
    torch.manual_seed(args.random_seed)
    code = 0
    try:
        run_main(serve_rank(args, rank, socket_path))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    exit_now(code)                     # device, channel, group and trace are closed by now

