"""Start a unified node: the rank processes, then the HTTP front on uvloop; stop it gracefully.

On SIGTERM or SIGINT the front stops taking requests (503, and /health says 503), lets those in
flight finish for up to --shutdown-timeout seconds, ends the rest with an error, stops the ranks
(each flushes its --trace-file) and returns 0. A second signal ends the wait at once. If the rank
supervisor gives up (too many rank deaths), serve returns 1.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from engine.args import ServerArgs
from engine.gc_pause import after_startup
from server.rank_client import RankEngineClient

log = logging.getLogger("tandem")
DRAIN_POLL_S = 0.1
ERROR_FLUSH_S = 2.0         # after ending the last requests: time for their handlers to answer


async def serve(args: ServerArgs) -> int:
    """Run the node --role says until a signal stops it (0) or its ranks keep dying (1)."""
    if args.node_rank > 0:
        from server.remote_ranks import serve_remote_ranks
        return await serve_remote_ranks(args)
    started = time.perf_counter()
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    engine, bootstrap = make_engine(args)
    tokenizer = None if args.role == "prefill" else asyncio.ensure_future(asyncio.to_thread(load_tokenizer, args))
    try:
        readies = await engine.start()              # the tokenizer loads meanwhile
        if bootstrap is not None:
            await bootstrap.start(readies)
        runner = await start_http(args, engine, readies, tokenizer)
        after_startup("front")
    except BaseException:
        await engine.close()
        raise
    log.info("serving %s as %s on http://%s:%d (start-up %.1f s, overlap %s)%s", args.model_name, args.role,
             args.host, args.port, time.perf_counter() - started, "on" if args.enable_overlap else "off",
             f"; decode nodes connect to port {args.disaggregation_bootstrap_port}" if bootstrap else "")
    try:
        code = await wait_for_stop(engine, signals)
        if code == 0:
            await drain(engine, signals, args.shutdown_timeout)
    finally:
        log.info("shutting down")
        if bootstrap is not None:
            await bootstrap.close()
        await runner.cleanup()
        await engine.close()
    return code


def make_engine(args: ServerArgs):
    """The node's engine client, and a prefill node's bootstrap server (None on other roles)."""
    if args.role == "unified":
        return RankEngineClient(args), None
    from server.pd.decode_client import DecodeEngineClient
    from server.pd.prefill_server import PrefillServer
    from engine.handshake import load_secret
    secret = load_secret(args.pd_secret)
    if args.role == "decode":
        engine = DecodeEngineClient(args, secret)
        engine.pd_stats = engine.prefill.stats
        return engine, None
    engine = RankEngineClient(args)
    bootstrap = PrefillServer(args, engine, secret)
    engine.pd_stats = bootstrap.stats
    return engine, bootstrap


PLAIN_FAST_TOKENIZERS = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(args: ServerArgs):
    """The model's tokenizer. A plain fast tokenizer (what the embedded models name) loads through
    its own class: AutoTokenizer imports transformers' model side and with it torch, into the front,
    a process that never runs a model (the default server's idle PSS 603-618 MB with it, 417-428
    without: bench/startup.py)."""
    from transformers import PreTrainedTokenizerFast
    if tokenizer_class(args.tokenizer) in PLAIN_FAST_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(args.tokenizer)


def tokenizer_class(path: str) -> str | None:
    """The tokenizer class a model folder's tokenizer_config.json names (None: no such file)."""
    config = Path(path) / "tokenizer_config.json"
    if not (config.is_file() and (Path(path) / "tokenizer.json").is_file()):
        return None
    return json.loads(config.read_text()).get("tokenizer_class")


async def start_http(args: ServerArgs, engine, readies, tokenizer: asyncio.Future | None) -> web.AppRunner:
    from server.app import create_app, create_prefill_app
    for r in readies:
        log.info("rank %d ready: %s, %d KV tokens", r.rank, r.description, r.kv_total)
    if tokenizer is None:
        app = create_prefill_app(args, engine)
    else:
        app = create_app(args, engine, await tokenizer, min(r.context_length for r in readies))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    return runner


async def wait_for_stop(engine: RankEngineClient, signals: asyncio.Queue) -> int:
    """0 when a signal asks the server to stop, 1 when the rank supervisor gave up."""
    got_signal = asyncio.ensure_future(signals.get())
    gave_up = asyncio.ensure_future(engine.gave_up.wait())
    await asyncio.wait({got_signal, gave_up}, return_when=asyncio.FIRST_COMPLETED)
    got_signal.cancel()
    gave_up.cancel()
    if engine.gave_up.is_set():
        log.error("exiting: %s", engine.give_up_reason)
        return 1
    return 0


async def drain(engine: RankEngineClient, signals: asyncio.Queue, timeout: float) -> None:
    """Refuse new requests; let those in flight finish for up to `timeout` s (or until a second
    signal), then end the rest with an error."""
    engine.draining = True
    log.info("stopping: %d requests in flight get up to %.0f s to finish (a second signal stops now)",
             engine.in_flight, timeout)
    deadline = time.monotonic() + timeout
    while engine.in_flight and time.monotonic() < deadline and signals.empty():
        await asyncio.sleep(DRAIN_POLL_S)
    if engine.in_flight:
        log.warning("ending %d requests that did not finish in time", engine.in_flight)
        engine.fail_all("the server is shutting down")
        flush_deadline = time.monotonic() + ERROR_FLUSH_S
        while engine.in_flight and time.monotonic() < flush_deadline:
            await asyncio.sleep(DRAIN_POLL_S)
