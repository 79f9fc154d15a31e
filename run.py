"""Launch Tandem: `python run.py` serves the embedded model on 127.0.0.1:30000."""
from __future__ import annotations

import logging
import sys

from engine.args import parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from server.pd.transport import transport
    try:                               # the registry lives with the server: engine/args.py cannot ask it
        transport(args.disaggregation_transfer_backend)
    except ValueError as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from engine.event_loop import run_main
    from server.launch import serve
    return run_main(serve(args))


if __name__ == "__main__":
    from engine.event_loop import exit_now
    exit_now(main())                   # serve() returns once the node has closed all it opened
