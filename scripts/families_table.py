"""Write the model families table (``lmforge.model.families.families_table``) into README.md
between its markers; ``--check`` exits 1 when the README's table is not the registry's.

    python scripts/families_table.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.model.families import families_table

START, END = "<!-- families: written by scripts/families_table.py -->", "<!-- /families -->"
README = Path(__file__).resolve().parents[1] / "README.md"


def with_table(text: str) -> str:
    """``text`` with the block between the markers replaced by the registry's table."""
    head, found, rest = text.partition(START)
    if not found or END not in rest:
        raise SystemExit(f"{README}: no {START} ... {END} block")
    return f"{head}{START}\n{families_table()}\n{END}{rest.partition(END)[2]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the README's table differs")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    new = with_table(text)
    if args.check:
        if new != text:
            print(f"{README}: the families table is stale; run python scripts/families_table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
