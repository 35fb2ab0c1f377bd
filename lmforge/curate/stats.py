"""Curation statistics: per shard (``ShardStats``, counted as the output is written) and merged
over the run (``merge_stats``: documents in and rejected per stage, by reason, languages,
duplicate-cluster sizes, score samples), what stats.json and the report show."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lmforge.curate.steps import StepSpec


def reason_key(reason: str) -> str:
    """The rule of a reason: its first word ("gopher_short_doc: 12 < 50" -> "gopher_short_doc")."""
    head = reason.strip().split(None, 1)[0] if reason.strip() else "unknown"
    return head.rstrip(":")


MAX_SCORE_SAMPLES = 20_000  # per shard and score, every k-th value beyond that


@dataclass
class ShardStats:
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)  # "stage\treason" -> n
    languages: dict[str, Counter] = field(default_factory=lambda: {"kept": Counter(), "rejected": Counter()})
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    dup_cluster_sizes: list[int] = field(default_factory=list)

    def add(self, meta: dict, stage: str | None, reason: str | None) -> None:
        side = "kept" if stage is None else "rejected"
        if stage is None:
            self.kept += 1
            if isinstance(meta.get("dup_cluster_size"), int):
                self.dup_cluster_sizes.append(meta["dup_cluster_size"])
        else:
            self.rejected[f"{stage}\t{reason_key(reason or '')}"] += 1
        if "language" in meta:
            self.languages[side][str(meta["language"])] += 1
        for key, value in meta.items():
            if key.endswith("_score") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values = self.scores.setdefault(key, {"kept": [], "rejected": []})[side]
                if len(values) < MAX_SCORE_SAMPLES:
                    values.append(float(value))

    def to_dict(self) -> dict:
        return {"kept": self.kept, "rejected": dict(self.rejected),
                "languages": {k: dict(v) for k, v in self.languages.items()},
                "scores": self.scores, "dup_cluster_sizes": self.dup_cluster_sizes}


def merge_stats(parts: list[dict], specs: list[StepSpec]) -> dict:
    by_stage: dict[str, Counter] = {}
    languages: dict[str, Counter] = {"kept": Counter(), "rejected": Counter()}
    scores: dict[str, dict[str, list[float]]] = {}
    clusters: list[int] = []
    kept = 0
    for p in parts:
        kept += p["kept"]
        for key, n in p["rejected"].items():
            stage, reason = key.split("\t", 1)
            by_stage.setdefault(stage, Counter())[reason] += n
        for side in ("kept", "rejected"):
            languages[side].update(p["languages"][side])
        for key, sides in p["scores"].items():
            for side, values in sides.items():
                scores.setdefault(key, {"kept": [], "rejected": []})[side].extend(values)
        clusters += p["dup_cluster_sizes"]
    order = ["read"] + [s.label for s in specs]
    stages = {}
    remaining = kept + sum(sum(c.values()) for c in by_stage.values())
    for stage in order + sorted(set(by_stage) - set(order)):
        counts = by_stage.get(stage, Counter())
        n = sum(counts.values())
        stages[stage] = {"in": remaining, "rejected": n, "reasons": dict(counts.most_common())}
        remaining -= n
    rejected = sum(s["rejected"] for s in stages.values())
    all_langs = languages["kept"] + languages["rejected"]
    return {
        "documents": kept + rejected,
        "kept": kept,
        "rejected": rejected,
        "stages": stages,
        "languages": {"all": dict(all_langs.most_common()), "kept": dict(languages["kept"].most_common())},
        "dup_cluster_sizes": dict(sorted(Counter(clusters).items())),
        "scores": scores,
    }
