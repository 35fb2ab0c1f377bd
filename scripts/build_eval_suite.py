"""Build the data of the bundled evaluation suite (data/eval/suite.yaml) from the demo's own data.

- ``data/eval/heldout/bpb_<domain>.jsonl``: text for bits per byte, per domain, from documents
  that the demo never trains on: those that ``lmforge prepare``'s split rule (``split: hash``,
  ``val_fraction`` 0.05 of recipes/demo/prepare.yaml: ``split_of(id, 0.05) == "val"``) sends to
  validation, in id order, each cut to its first ``--doc-bytes`` bytes at a line end, at most
  ``--docs`` per domain. Domains: Shakespeare, Milton and the Python docs (data/pretrain/), and
  the curated web pages (the parquet output of recipes/demo/curate.yaml over data/web/).
- ``data/eval/demo_choices.jsonl``: the held-out SFT tasks (data/sft/val.jsonl) as four-way
  multiple choice, their distractors made by the task rules (``sft_demo.choice_example``).

  .venv/bin/python scripts/build_eval_suite.py --curated runs/demo/curate/output
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmforge.data.documents import DocumentsConfig, read_documents, split_of
from lmforge.data.sft_demo import choice_example

VAL_FRACTION = 0.05  # recipes/demo/prepare.yaml
DOMAINS = {"shakespeare": "data/pretrain/shakespeare.jsonl", "milton": "data/pretrain/milton.jsonl",
           "python_docs": "data/pretrain/python_docs.jsonl"}


def cut_at_line(text: str, max_bytes: int) -> str:
    """The longest run of whole lines of ``text`` within ``max_bytes`` UTF-8 bytes (all of it if it fits)."""
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    head = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return head[: head.rfind("\n") + 1] if "\n" in head else head


def held_out(paths: list[str], docs: int, doc_bytes: int) -> list[dict]:
    """The first ``docs`` validation documents of ``paths`` by id, each cut to ``doc_bytes``."""
    val = sorted((d for d in read_documents(DocumentsConfig(paths=paths)) if split_of(d.id, VAL_FRACTION) == "val"),
                 key=lambda d: d.id)
    if not val:
        raise SystemExit(f"{paths}: no document is in the validation split")
    return [{"id": d.id, "text": cut_at_line(d.text, doc_bytes)} for d in val[:docs]]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} rows, {path.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--curated", default="runs/demo/curate/output", help="the demo curation's output folder")
    parser.add_argument("--docs", type=int, default=3, help="held-out documents per domain")
    parser.add_argument("--doc-bytes", type=int, default=4000, help="bytes of each document scored")
    parser.add_argument("--out", default="data/eval")
    args = parser.parse_args()
    out = Path(args.out)
    domains = {**{k: [v] for k, v in DOMAINS.items()}, "web": sorted(str(p) for p in Path(args.curated).glob("*.parquet"))}
    if not domains["web"]:
        raise SystemExit(f"{args.curated}: no parquet files; run `lmforge curate recipes/demo/curate.yaml` first")
    for name, paths in domains.items():
        write_jsonl(out / "heldout" / f"bpb_{name}.jsonl", held_out(paths, args.docs, args.doc_bytes))
    examples = [json.loads(line) for line in Path("data/sft/val.jsonl").read_text(encoding="utf-8").splitlines()]
    write_jsonl(out / "demo_choices.jsonl", [choice_example(ex) for ex in examples])


if __name__ == "__main__":
    main()
