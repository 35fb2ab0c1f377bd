"""The curation pipeline: its config, and the driver that runs the steps over the shards.

The steps are cut into segments at each corpus step (``plan.py``). Segment 0 reads each input
shard and runs the document steps before the first corpus step; each later segment starts
with a corpus step (``index_shard`` on every shard, ``resolve`` once, ``apply_shard`` on every
shard) and continues with the document steps after it. Finally each shard's kept documents
go to ``output/`` and all its rejects, with stage and reason, to ``rejects/`` (the shard
tasks: ``tasks.py``). Between segment 0 and the rest, repeated input ids are made unique
(``ids.py``). The statistics are merged (``stats.py``) into stats.json and the report
(``report.py``).

Every shard task writes its files atomically and then a completion marker, so an
interrupted run, started again, redoes only unfinished tasks. Markers carry a fingerprint
of the inputs and of the steps up to their segment, with the files the steps' configs name
(a blocklist, a model folder): change a step or such a file and that segment and the ones
after it run again, the earlier ones are reused.

    run_dir/
      config.yaml, stats.json, report.md, report.png
      output/shard-00000.parquet    id, text, metadata (JSON)   -- what `lmforge prepare` reads
      rejects/shard-00000.jsonl     id, text, metadata, stage, reason
      work/                         per-segment documents, corpus-step indexes, markers
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from lmforge.core.config import at_least, option, save_config
from lmforge.core.io import InputError, atomic_write_bytes
from lmforge.core.run import log, progress_bar, run_dir_lock
from lmforge.curate.executor import make_executor
from lmforge.curate.ids import resolve_ids
from lmforge.curate.plan import Job, clean_leftovers, digest, fresh, seg_dir, segment_fingerprints, split_segments
from lmforge.curate.readers import InputsConfig, plan_shards
from lmforge.curate.report import dedup_quality, load_known_pairs, write_report
from lmforge.curate.stats import merge_stats
from lmforge.curate.steps import StepSpec, parse_steps
from lmforge.curate.tasks import close_built_steps, finalize_shard, run_index_shard, run_segment_shard

DEFAULT_STEPS: list[dict[str, Any]] = [
    {"type": "extract"},
    {"type": "language"},
    {"type": "gopher_repetition"},
    {"type": "gopher_quality"},
    {"type": "c4_quality", "filter_no_terminal_punct": False},
    {"type": "fineweb_quality"},
    {"type": "exact_dedup"},
]


@dataclass
class CurateConfig:
    run_dir: str = option(
        "runs/curate",
        help="receives output/ (the kept documents, what `lmforge prepare` reads), rejects/, stats.json, report.md",
    )
    inputs: InputsConfig = field(default_factory=InputsConfig)
    steps: list[dict[str, Any]] = option(
        default_factory=lambda: [dict(s) for s in DEFAULT_STEPS],
        help="each step: {type: <step type>, name: <optional label>, <that type's keys>}; see docs/curate.md",
    )
    output_format: Literal["parquet", "jsonl"] = option("parquet", help="the file format of output/'s shards")
    executor: Literal["local", "ray"] = option(
        "local", help="local: processes on this machine; ray: tasks on a Ray cluster"
    )
    workers: int = at_least(1, 2, help="local processes (1: in this process), or CPUs of a local Ray")
    ray_address: str | None = option(None, help='executor ray: "auto" joins a running cluster; null starts one')
    known_duplicates: str | None = option(
        None, help="TSV url_a, url_b[, kind, jaccard]: dedup precision/recall in the report"
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        # check every step's keys now and store them resolved, with defaults, in config.yaml
        self.steps = [spec.to_dict() for spec in parse_steps(self.steps)]

    def step_specs(self) -> list[StepSpec]:
        return parse_steps(self.steps)


def run_tasks(pool: Any, fn: Any, items: list, desc: str) -> list:
    bar = progress_bar(len(items), desc, unit="shard")
    out = []
    for result in pool.imap(fn, items):
        out.append(result)
        bar.update(1)
    bar.close()
    return out


def _star(fn: Any, args: tuple) -> Any:
    return fn(*args)


def check_inputs(cfg: CurateConfig, specs: list[StepSpec]) -> None:
    """Before any work: the files the recipe names besides the inputs (a step's model, checkpoint or
    list, ``known_duplicates``) exist and read; the error names the key and the path."""
    for i, spec in enumerate(specs):
        if (check := getattr(spec.config, "check_inputs", None)) is not None:
            check(f"steps[{i}]")
    if cfg.known_duplicates:
        if not Path(cfg.known_duplicates).exists():
            raise InputError(f"known_duplicates: {cfg.known_duplicates}: no such file (a TSV with the header "
                             f"url_a<TAB>url_b[<TAB>kind<TAB>jaccard])")
        try:
            load_known_pairs(cfg.known_duplicates)  # its header and numbers, named by line
        except InputError as exc:
            raise InputError(f"known_duplicates: {exc}") from exc


def run_curate(cfg: CurateConfig) -> dict:
    """Run the pipeline described by ``cfg``; return the statistics also written to stats.json."""
    specs = cfg.step_specs()
    check_inputs(cfg, specs)
    with run_dir_lock(cfg.run_dir):  # a second curate into it fails at once, naming this one
        return curate(cfg, specs)


def curate(cfg: CurateConfig, specs: list[StepSpec]) -> dict:
    """``run_curate`` in its locked run directory."""
    t0 = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    shards = plan_shards(cfg.inputs)
    segments = split_segments(specs)
    fingerprints = segment_fingerprints(cfg.inputs, shards, segments)
    job = Job(str(run_dir), cfg.inputs, shards, segments, fingerprints, cfg.output_format)
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_leftovers(run_dir, len(segments))
    save_config(cfg, run_dir)
    n = len(shards)
    log.info("curate: %d shards, %d steps in %d segments, executor %s with %d workers",
             n, len(specs), len(segments), cfg.executor, cfg.workers)
    ran = skipped = 0
    pool = make_executor(cfg.executor, cfg.workers, cfg.ray_address)
    try:
        for seg, segment in enumerate(segments):
            directory = seg_dir(job, seg)
            fresh(directory, fingerprints[seg])
            if segment.corpus is not None:
                done = run_tasks(pool, partial(_star, run_index_shard), [(job, seg, k) for k in range(n)],
                                 f"{segment.corpus.label} index")
                skipped += sum(done)
                ran += len(done) - sum(done)
                resolved = directory / "resolve.done"
                if not resolved.exists():
                    segment.corpus.build().resolve(directory / "step", n, pool)
                    atomic_write_bytes(resolved, b"")
                    ran += 1
                else:
                    skipped += 1
            desc = ", ".join(s.label for s in segment.steps) or "read"
            results = run_tasks(pool, partial(_star, run_segment_shard), [(job, seg, k) for k in range(n)],
                                f"{segment.corpus.label + ' apply' if segment.corpus else 'read'}: {desc}")
            skipped += sum(r["skipped"] for r in results)
            ran += sum(not r["skipped"] for r in results)
            if seg == 0:
                n_input = sum(r["in"] for r in results)
                if n_input == 0:
                    raise InputError(f"no documents in {', '.join(cfg.inputs.paths)}: the input is empty (a WARC's "
                                     f"records count when of a type in inputs.warc_record_types: "
                                     f"{', '.join(cfg.inputs.warc_record_types)})")
                reused = resolve_ids(job, results, pool)
                skipped += reused
                ran += not reused
        final_fp = digest(fingerprints[-1], cfg.output_format)
        fresh(run_dir / "work" / "final", final_fp, clear=(run_dir / "output", run_dir / "rejects"))
        parts = run_tasks(pool, partial(finalize_shard, job), list(range(n)), "write output")
        skipped += sum(p["skipped"] for p in parts)
        ran += sum(not p["skipped"] for p in parts)
    finally:
        pool.close()
        close_built_steps()
    stats = merge_stats(parts, specs)
    if stats["documents"] != n_input:
        raise RuntimeError(f"curate lost documents: read {n_input}, kept {stats['kept']} + rejected {stats['rejected']}")
    stats.update(input_shards=n, tasks_run=ran, tasks_skipped=skipped, wall_s=round(time.perf_counter() - t0, 2),
                 workers=cfg.workers, executor=cfg.executor, output=str(run_dir / "output"),
                 rejects=str(run_dir / "rejects"))
    if cfg.known_duplicates:
        stats["dedup"] = dedup_quality(run_dir, specs, cfg.known_duplicates)
    write_report(run_dir, stats)
    log.info("curate: %d documents -> %d kept, %d rejected in %.1f s -> %s", stats["documents"], stats["kept"],
             stats["rejected"], stats["wall_s"], run_dir)
    return stats


__all__ = ["CurateConfig", "run_curate"]
