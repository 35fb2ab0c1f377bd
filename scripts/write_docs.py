"""Write the README's demo results, between its markers, from the report of a ``make demo`` in which
every stage completed (``runs/demo/report.md``): the report card (the same tasks on each stage's
final model) and each stage's time. Run it on the machine that ran the demo, which the block names
(or say which with ``--machine``).

    make demo && python scripts/write_docs.py      # rewrite the block from runs/demo/report.md
    python scripts/write_docs.py --check            # exit 1 if the README's block is not that report's

A report with a stage stopped early by a time limit (``train.max_minutes``) is refused: its figures
are of a partly trained model. With no report, ``--check`` only checks that the block is there.
The README's model families table is written by ``scripts/families_table.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
REPORT = REPO / "runs" / "demo" / "report.md"
START = "<!-- demo-results: written by scripts/write_docs.py from runs/demo/report.md -->"
END = "<!-- /demo-results -->"


class ReportError(ValueError):
    """The report cannot give the README's figures (stopped early, or no report card)."""


def table_after(lines: list[str], start: int) -> list[str]:
    """The Markdown table whose header is the first ``|`` line at or after ``start``."""
    first = next((i for i in range(start, len(lines)) if lines[i].startswith("|")), None)
    if first is None:
        return []
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[first:end]


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def stage_rows(lines: list[str]) -> list[dict[str, str]]:
    """The report's stage table (stage, verb, status, seconds, ...) as one dict per stage."""
    table = table_after(lines, 0)
    if not table or cells(table[0])[:1] != ["stage"]:
        raise ReportError("no stage table at the top of the report")
    header = cells(table[0])
    return [dict(zip(header, cells(row))) for row in table[2:]]


def demo_block(report: str, machine: str, date: str) -> str:
    """The block's text: the report card as it is in the report, then the stages' times."""
    if "**Stopped early:**" in report:
        raise ReportError("a stage was stopped early by a time limit: its figures are of a partly trained model; "
                          "run `make demo` again to finish it")
    lines = report.splitlines()
    stages = stage_rows(lines)
    if any(s.get("status", "").startswith("stopped early") for s in stages):
        raise ReportError("a stage was stopped early by a time limit; run `make demo` again to finish it")
    heading = next((i for i, line in enumerate(lines) if line.strip() == "## report card"), None)
    card = table_after(lines, heading + 1) if heading is not None else []
    if not card:
        raise ReportError("the report has no report card (the lifecycle's report_card: section)")
    seconds = [float(s["seconds"]) for s in stages]
    total = sum(seconds)
    times = ", ".join(f"{s['stage']} {float(s['seconds']):.0f} s" for s in stages)
    return "\n".join([
        f"`make demo` on {machine}, {date}: every stage completed. The report card, the same tasks on each "
        "stage's final model (`core`: accuracies centred on chance, averaged):",
        "",
        *card,
        "",
        f"Stage times: {times}; {int(total // 60)} min {total % 60:.0f} s in all. "
        "Each stage's own figures are in `runs/demo/report.md`.",
    ])


def with_block(text: str, body: str) -> str:
    """``text`` with the block between the markers replaced by ``body``."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{README}: no {START} ... {END} block")
    return pattern.sub(lambda _: f"{START}\n{body}\n{END}", text, count=1)


def figures(block: str) -> list[str]:
    """The block's lines but its first (which names the machine and the date)."""
    return block.splitlines()[1:]


def this_machine() -> str:
    import torch

    from lmforge.stages.doctor import cpu_info

    cpu = cpu_info()
    return f"{cpu['model']}, {cpu['usable_cores']} cores, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the README's block is not the report's")
    parser.add_argument("--report", type=Path, default=REPORT, help="the lifecycle's report (default runs/demo/report.md)")
    parser.add_argument("--readme", type=Path, default=README, help="the file whose block is written (default README.md)")
    parser.add_argument("--machine", help="the machine the demo ran on (default: this one, as lmforge doctor names it)")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    if not args.report.is_file():
        with_block(text, "")  # the block must be there, whatever it holds
        if args.check:
            print(f"{args.report}: no report (run make demo); the block in {args.readme} is not compared", file=sys.stderr)
            return 0
        print(f"{args.report}: no report; run make demo first", file=sys.stderr)
        return 1
    report = args.report.read_text(encoding="utf-8")
    date = datetime.fromtimestamp(args.report.stat().st_mtime).date().isoformat()
    if args.check:
        # the machine and date are the block's own: compare the figures, which come from the report
        current = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), text, re.S)
        written = current.group(1) if current else ""
        try:
            expected = demo_block(report, "MACHINE", "DATE")
        except ReportError as exc:
            print(f"{args.report}: {exc}; the block in {args.readme} is not compared", file=sys.stderr)
            return 0
        if figures(written) != figures(expected):
            print(f"{args.readme}: the demo results are not {args.report}'s; run python scripts/write_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    try:
        body = demo_block(report, args.machine or this_machine(), date)
    except ReportError as exc:
        print(f"{args.report}: {exc}", file=sys.stderr)
        return 1
    args.readme.write_text(with_block(text, body), encoding="utf-8")
    print(f"wrote the demo results of {args.report} into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
