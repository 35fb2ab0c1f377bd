"""Write the model families table (``lmforge.model.families.families_table``) between its markers
in README.md (the support matrix) and docs/architectures.md; ``--check`` exits 1 when a file's
table is not the registry's.

    python scripts/families_table.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.model.families import families_table

START, END = "<!-- families: written by scripts/families_table.py -->", "<!-- /families -->"
REPO = Path(__file__).resolve().parents[1]
FILES = [REPO / "README.md", REPO / "docs" / "architectures.md"]


def with_table(text: str, path: Path) -> str:
    """``text`` (of ``path``) with the block between the markers replaced by the registry's table."""
    head, found, rest = text.partition(START)
    if not found or END not in rest:
        raise SystemExit(f"{path}: no {START} ... {END} block")
    return f"{head}{START}\n{families_table()}\n{END}{rest.partition(END)[2]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file's table differs")
    args = parser.parse_args()
    stale = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        new = with_table(text, path)
        if new == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(new, encoding="utf-8")
            print(f"wrote the families table into {path}")
    for path in stale:
        print(f"{path}: the families table is stale; run python scripts/families_table.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
