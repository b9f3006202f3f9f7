"""Write docs/guide/configuration-reference.md from the config schema (asyncrl/config/).

python scripts/config_reference.py           # rewrite the page
python scripts/config_reference.py --check   # exit 1 if the committed page is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncrl.config.reference import REFERENCE_PATH, reference_markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    args = p.parse_args(argv)
    path = Path(__file__).resolve().parent.parent / REFERENCE_PATH
    text = reference_markdown()
    if args.check:
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            print(f"{REFERENCE_PATH} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        print(f"{REFERENCE_PATH} is up to date")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
