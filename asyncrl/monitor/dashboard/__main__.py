"""`python -m asyncrl.monitor.dashboard [RUN_DIR | --redis URL] [...]`: `asyncrl dashboard`,
for environments without the console script (same arguments, checks and messages).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from asyncrl.cli import main as cli_main

    return cli_main(["dashboard", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
