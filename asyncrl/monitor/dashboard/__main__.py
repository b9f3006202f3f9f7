"""`python -m asyncrl.monitor.dashboard [RUN_DIR | --redis URL] [...]`, also what `asyncrl
dashboard` runs (the command line hands the dashboard its arguments): one set of arguments,
checks and messages for both.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from asyncrl.infra import UsageError, run_command
from asyncrl.monitor.dashboard.app import CONNECT_TIMEOUT_S, serve

PROG = "asyncrl dashboard"


def _parser() -> argparse.ArgumentParser:
    d = argparse.ArgumentParser(
        prog=PROG, description="serve the staleness/drift dashboard (a live run's Redis or a run dir)"
    )
    d.add_argument("run_dir", nargs="?", help="a finished run's directory (control.run_dir): reads its metrics.jsonl")
    d.add_argument(
        "--redis", default=None, metavar="URL", help="a live run's Redis URL (the trainer logs it: queue.redis_url)"
    )
    d.add_argument(
        "--run",
        default=None,
        metavar="NAME",
        help="with --redis: open this run (control.run_name); default: the page lists the runs in that Redis",
    )
    d.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: 127.0.0.1, this machine only; another address needs --token; "
        "from a remote box, prefer `ssh -L 8470:127.0.0.1:8470 HOST`)",
    )
    d.add_argument("--port", type=int, default=8470, help="the port to listen on (default: 8470)")
    d.add_argument(
        "--token",
        default=os.environ.get("ASYNCRL_DASHBOARD_TOKEN"),
        help="a secret of 16+ characters every request must carry (?token=, a Bearer header or the cookie it "
        "sets); default: $ASYNCRL_DASHBOARD_TOKEN, else none (loopback only)",
    )
    d.add_argument(
        "--password",
        default=os.environ.get("ASYNCRL_REDIS_PASSWORD"),
        help="with --redis: the Redis password when the URL has none (default: $ASYNCRL_REDIS_PASSWORD)",
    )
    d.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"with --redis: how long to retry it before refusing to start (default: {CONNECT_TIMEOUT_S:g})",
    )
    d.add_argument("-v", "--verbose", action="store_true", help="a failure's traceback, not only its line")
    return d


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if (args.run_dir is None) == (args.redis is None):
        what = "both given" if args.redis else "neither given"
        print(f"{PROG}: give a RUN_DIR (a finished run) or --redis URL (live): {what}", file=sys.stderr)
        return 2
    if args.run_dir is not None and args.run is not None:
        print(f"{PROG}: --run is for --redis; a RUN_DIR holds one run", file=sys.stderr)
        return 2

    def start() -> int:
        try:
            serve(
                args.redis,
                run=args.run,
                host=args.host,
                port=args.port,
                token=args.token,
                password=args.password,
                run_dir=args.run_dir,
                connect_timeout_s=args.connect_timeout,
            )
        except (ValueError, FileNotFoundError) as e:  # guard.check_host's refusals, a bad URL, no plotly.min.js
            raise UsageError(str(e)) from e
        return 0

    return run_command(PROG, start, verbose=args.verbose)


if __name__ == "__main__":
    # As `asyncrl dashboard` sets it up.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    sys.exit(main())
