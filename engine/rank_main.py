"""Entry point of a rank process: its own uvloop, the model, and the rank loop,
connected to the front over a unix socket."""
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
from engine.framing import Connection
from engine.handshake import handshake, load_secret
from engine.rank import Rank

log = logging.getLogger(__name__)
TERM_GRACE_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0


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


async def connect_front(address: str, secret: bytes | None) -> Connection:
    """The front's socket: a unix path, or tcp://HOST:PORT (ranks on another host); the handshake
    proves the --rank-secret when there is one."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
    else:
        reader, writer = await asyncio.open_unix_connection(address)
    conn = Connection(reader, writer, ToRank, kind="rank")
    await handshake(conn, "rank", "", secret, HANDSHAKE_TIMEOUT_S)
    return conn


async def serve_rank(args: ServerArgs, rank: int, socket_path: str) -> None:
    device = create_device(args.device, rank % (args.dp_size // args.nnodes))
    device.set_threads(cpu_threads(args))
    dp = DpGroup(rank, args.dp_size, args.dist_init_addr, device.collective_backend, device.torch_device) \
        if args.enable_dp_attention else None
    channel = await connect_front(socket_path, load_secret(args.rank_secret, "--rank-secret"))
    # eos ids come from the checkpoint's own config files
    config = read_target_config(args.model_path)
    worker = Rank(args, rank, device, channel, eos_token_ids(args.model_path, config), dp)
    # SIGTERM (a process-group kill, say): the front drives the shutdown; stop anyway if it never does
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.call_later(args.shutdown_timeout + TERM_GRACE_S, worker.stop))
    await channel.send(RankReady(rank=rank, kv_total=worker.pool.total_slots,
                                 context_length=worker.runner.context_length,
                                 description=f"{Path(args.model_path).name} on {device.torch_device}",
                                 dtype=str(worker.runner.dtype).removeprefix("torch."),
                                 kv_dtype=str(worker.runner.target.kv.k[0].dtype).removeprefix("torch."),
                                 draft_weights=getattr(worker.runner.decoding, "draft_weights", None)))
    try:
        await worker.run()
    except EngineBroken as exc:
        log.error("rank %d: %s; exiting so that the front starts a new rank", rank, exc)
        raise SystemExit(3) from None
    except GroupBroken as exc:
        log.error("rank %d: %s; exiting so that the front restarts the group", rank, exc)
        raise SystemExit(4) from None
    finally:
        device.close()
        channel.close("the rank stopped")
        if dp is not None:
            dp.close()


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

