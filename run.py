"""Launch Tandem: `python run.py` serves the embedded model on 127.0.0.1:30000."""
from __future__ import annotations

import logging
import os
import sys

from engine.args import parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from server.launch import serve
    try:
        import uvloop
    except ImportError:
        import asyncio
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    code = main()
    # The node has closed all it opened: skip the interpreter's teardown of torch and transformers
    # (a second or more of every stop).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
