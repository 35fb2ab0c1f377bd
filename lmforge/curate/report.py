"""The curation report: stats.json, report.md and report.png, and dedup quality against known pairs.

Dedup quality: documents that reached the first dedup step (kept, or rejected by it or a
later step) are grouped into predicted clusters: the same ``metadata["dup_cluster"]``
(MinHash), or a rejection "exact-duplicate of <id>" / "near-duplicate of <id>" by a dedup
step. The pipeline makes ids unique (``ids.py``), so an id names one page.
Every pair of URLs in a cluster is a predicted pair; precision and recall are measured
against the known pairs whose two pages both reached dedup.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

from lmforge.core.io import InputError, atomic_write_bytes, atomic_write_json, atomic_write_text
from lmforge.curate.records import iter_run_records
from lmforge.curate.steps import StepSpec

DEDUP_TYPES = ("exact_dedup", "minhash")
_DUPLICATE_OF = re.compile(r"(?:exact|near)-duplicate of (.+)")  # the reasons of exact_dedup and minhash


def load_known_pairs(path: str | Path) -> dict[tuple[str, str], float | None]:
    """{(url_a, url_b) sorted: jaccard or None} from a TSV with a header naming url_a and url_b."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read known duplicates: {exc.strerror or exc}") from exc
    pairs: dict[tuple[str, str], float | None] = {}
    for lineno, row in enumerate(rows, start=2):
        a, b = row.get("url_a"), row.get("url_b")
        if not a or not b:
            raise InputError(f"{path}:{lineno}: needs url_a and url_b columns (header: url_a<TAB>url_b[<TAB>kind<TAB>jaccard])")
        try:
            jaccard = float(row["jaccard"]) if row.get("jaccard") else None
        except ValueError as exc:
            raise InputError(f"{path}:{lineno}: jaccard {row['jaccard']!r} is not a number") from exc
        pairs[tuple(sorted((a, b)))] = jaccard
    return pairs


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: Any, b: Any) -> None:
        self.parent[self.find(a)] = self.find(b)


def dedup_quality(run_dir: Path, specs: list[StepSpec], known_path: str | Path) -> dict:
    known = load_known_pairs(known_path)
    dedup_labels = {s.label for s in specs if s.type in DEDUP_TYPES
                    and getattr(s.config, "unit", "document") == "document"}
    order = {s.label: i for i, s in enumerate(specs)}
    order["read"] = -1
    if not dedup_labels:
        return {"error": "no document-level dedup step (exact_dedup or minhash) in the recipe"}
    first = min(order[label] for label in dedup_labels)
    uf = _UnionFind()
    url_of: dict[str, str] = {}
    for record, stage, reason in iter_run_records(run_dir):
        if stage is not None and order.get(stage, len(order)) < first:
            continue
        doc_id, meta = record["id"], record["metadata"]
        if meta.get("url"):
            url_of[doc_id] = meta["url"]
        uf.find(doc_id)
        if meta.get("dup_cluster") is not None:
            uf.union(doc_id, ("cluster", str(meta["dup_cluster"])))
        if stage in dedup_labels and reason and (m := _DUPLICATE_OF.fullmatch(reason)):
            uf.union(doc_id, m.group(1))
    clusters: dict[Any, dict[str, None]] = {}  # a page fetched twice is one URL of its cluster, not a pair
    for doc_id, url in url_of.items():
        clusters.setdefault(uf.find(doc_id), {})[url] = None
    predicted = {tuple(sorted((a, b))) for urls in map(list, clusters.values()) for i, a in enumerate(urls) for b in urls[i + 1:]}
    reached = set(url_of.values())
    evaluable = {p: j for p, j in known.items() if p[0] in reached and p[1] in reached}
    hits = predicted & set(evaluable)
    high = {p for p, j in evaluable.items() if j is not None and j >= 0.8}
    return {
        "known_pairs": len(known),
        "evaluable_pairs": len(evaluable),  # both pages reached dedup
        "predicted_pairs": len(predicted),
        "true_positives": len(hits),
        "precision": round(len(hits) / len(predicted), 4) if predicted else None,
        "recall": round(len(hits) / len(evaluable), 4) if evaluable else None,
        "recall_jaccard_ge_0.8": round(len(hits & high) / len(high), 4) if high else None,
        "pairs_jaccard_ge_0.8": len(high),
    }


# --------------------------------------------------------------------------- files


def write_report(run_dir: Path, stats: dict) -> None:
    plotted = plot_stats(stats, run_dir / "report.png")
    stats = {**stats, "plot": "report.png" if plotted else None}
    atomic_write_json(run_dir / "stats.json", stats)
    atomic_write_text(run_dir / "report.md", "\n".join(["# Curation report", "", *report_lines(stats)]) + "\n")


def report_lines(stats: dict, plot: str | None = "report.png") -> list[str]:
    docs = stats["documents"]
    pct = (lambda n: f"{100 * n / docs:.1f}%") if docs else (lambda n: "-")
    out = [f"- {docs} documents in {stats.get('input_shards', '?')} shards: **{stats['kept']} kept** "
           f"({pct(stats['kept'])}), {stats['rejected']} rejected; {stats.get('wall_s', 0):.1f} s with "
           f"{stats.get('workers')} {stats.get('executor')} workers",
           "", "| stage | in | rejected | reasons |", "|---|---|---|---|"]
    for stage, s in stats["stages"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in list(s["reasons"].items())[:6])
        out.append(f"| {stage} | {s['in']} | {s['rejected']} | {reasons} |")
    if stats["languages"]["all"]:
        out += ["", "| language | documents | kept |", "|---|---|---|"]
        for lang, n in list(stats["languages"]["all"].items())[:15]:
            out.append(f"| {lang} | {n} | {stats['languages']['kept'].get(lang, 0)} |")
    if stats["dup_cluster_sizes"]:
        sizes = ", ".join(f"{k}: {v}" for k, v in stats["dup_cluster_sizes"].items())
        out += ["", f"- duplicate-cluster sizes of kept documents (size: count): {sizes}"]
    d = stats.get("dedup")
    if d and "error" not in d:
        out += ["", f"- dedup against known pairs: precision **{d['precision']}**, recall **{d['recall']}** "
                    f"({d['true_positives']} of {d['evaluable_pairs']} pairs whose pages reached dedup; "
                    f"{d['predicted_pairs']} predicted; recall at Jaccard >= 0.8: {d['recall_jaccard_ge_0.8']})"]
    elif d:
        out += ["", f"- dedup against known pairs: {d['error']}"]
    for key, sides in stats["scores"].items():
        values = sides["kept"] + sides["rejected"]
        if values:
            values = sorted(values)
            out.append(f"- {key}: n={len(values)}, median {values[len(values) // 2]:.3g} "
                       f"(min {values[0]:.3g}, max {values[-1]:.3g})")
    if plot and stats.get("plot"):
        out += ["", f"![curation statistics]({plot})"]
    return out


def plot_stats(stats: dict, path: Path) -> bool:
    """Rejections per stage, languages, duplicate-cluster sizes and each score's histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 + len(stats["scores"])
    cols = min(panels, 3)
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    ax = axes.flat
    stages = {k: v["rejected"] for k, v in stats["stages"].items()}
    a = next(ax)
    a.barh(list(stages)[::-1], list(stages.values())[::-1])
    a.set_title(f"rejected per stage ({stats['kept']} of {stats['documents']} kept)")
    a = next(ax)
    langs = list(stats["languages"]["all"].items())[:12]
    if langs:
        names = [k for k, _ in langs]
        a.bar(names, [v for _, v in langs], label="all")
        a.bar(names, [stats["languages"]["kept"].get(k, 0) for k in names], label="kept")
        a.legend()
    a.set_title("languages")
    a = next(ax)
    sizes = stats["dup_cluster_sizes"]
    if sizes:
        a.bar([str(k) for k in sizes], list(sizes.values()))
    a.set_title("duplicate-cluster sizes (kept docs)")
    for key, sides in stats["scores"].items():
        a = next(ax)
        for side in ("rejected", "kept"):
            if sides[side]:
                a.hist(sides[side], bins=30, alpha=0.6, label=side)
        a.legend()
        a.set_title(key)
    for rest in ax:
        rest.axis("off")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    atomic_write_bytes(path, buf.getvalue())  # as stats.json and report.md: a killed run leaves no half image
    plt.close(fig)
    return True
