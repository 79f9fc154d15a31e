"""Start a unified node: the rank processes, then the HTTP front on uvloop."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from engine.args import ServerArgs
from server.rank_client import RankEngineClient

log = logging.getLogger("tandem")


async def serve(args: ServerArgs) -> None:
    from transformers import AutoTokenizer
    from server.app import create_app

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    engine = RankEngineClient(args)
    readies = await engine.start()
    context_length = min(r.context_length for r in readies)
    for r in readies:
        log.info("rank %d ready: %s, %d KV tokens", r.rank, r.description, r.kv_total)
    runner = web.AppRunner(create_app(args, engine, tokenizer, context_length), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("serving %s on http://%s:%d (start-up %.1f s, overlap %s)", args.model_name, args.host, args.port,
             time.perf_counter() - started, "on" if args.enable_overlap else "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
        await engine.close()
