"""Run a process's main coroutine on uvloop, or on asyncio's own loop where uvloop is missing (the
front in run.py, each rank in engine/rank_main.py). Imports no torch."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine


def run_main(main: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def exit_now(code: int) -> None:
    """End the process once it has closed all it opened: logs and stdio flushed, the interpreter's own
    teardown of torch, transformers and the model skipped (a second or more of every stop and restart)."""
    import logging
    import os
    import sys
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
