"""`python -m asyncrl.monitor.dashboard --redis URL [--run NAME] [--host H] [--port P] [--token T]`,
or `python -m asyncrl.monitor.dashboard RUN_DIR [...]` for a finished run (`asyncrl dashboard` is the same).

The token may also come from $ASYNCRL_DASHBOARD_TOKEN (keeps it out of `ps` listings), the
Redis password from $ASYNCRL_REDIS_PASSWORD.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.monitor.dashboard", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", help="a finished run's directory (reads its metrics.jsonl)")
    p.add_argument("--redis", default=None, help="redis:// URL of the live run's Redis")
    p.add_argument("--run", default=None, help="open this run directly (default: the runs page)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--token", default=os.environ.get("ASYNCRL_DASHBOARD_TOKEN"))
    p.add_argument("--password", default=os.environ.get("ASYNCRL_REDIS_PASSWORD"))
    args = p.parse_args(argv)
    from asyncrl.monitor.dashboard.app import serve

    try:
        serve(
            args.redis,
            run=args.run,
            host=args.host,
            port=args.port,
            token=args.token,
            password=args.password,
            run_dir=args.run_dir,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
