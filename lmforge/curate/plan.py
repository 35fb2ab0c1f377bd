"""The plan of a curation run: its segments, their fingerprints, and the work folders.

The steps are cut into segments at each corpus step (``split_segments``). Markers carry a
fingerprint of the inputs and of the steps up to their segment, with the files the steps'
configs name (a blocklist, a model folder): change a step or such a file and that segment
and the ones after it run again, the earlier ones are reused (``segment_fingerprints``, ``fresh``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.core.config import dump_config
from lmforge.core.io import file_stamps, is_temporary, named_paths
from lmforge.curate.readers import InputsConfig, Piece
from lmforge.curate.steps import StepSpec, is_corpus_step


@dataclass
class Segment:
    corpus: StepSpec | None  # the corpus step this segment starts with (None for segment 0)
    steps: list[StepSpec]  # document steps after it


@dataclass
class Job:
    """Everything a worker needs for one run; small and picklable."""

    run_dir: str
    inputs: InputsConfig
    shards: list[list[Piece]]
    segments: list[Segment]
    fingerprints: list[str]  # per segment, cumulative
    output_format: str


def split_segments(specs: list[StepSpec]) -> list[Segment]:
    segments = [Segment(None, [])]
    for spec in specs:
        if is_corpus_step(_step_class(spec)):
            segments.append(Segment(spec, []))
        else:
            segments[-1].steps.append(spec)
    return segments


def _step_class(spec: StepSpec) -> type:
    from lmforge.curate.steps import _load

    return _load(spec.type)[1]


WORK_LAYOUT = 2  # what work/ holds; a change makes an older run's work folders redo everything


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _step_fingerprint(spec: StepSpec) -> list:
    config = spec.to_dict()
    return [config, file_stamps(named_paths(config))]  # and what the step reads besides documents


def segment_fingerprints(inputs: InputsConfig, shards: list[list[Piece]], segments: list[Segment]) -> list[str]:
    """Per segment, a digest of the inputs (paths, sizes, mtimes), of the steps up to it and of
    the files those steps name, so changing any of them reruns that segment and the later ones."""
    files = sorted({p.path for s in shards for p in s})
    fp = digest(WORK_LAYOUT, dump_config(inputs), [[vars(p) for p in s] for s in shards], file_stamps(files))
    out = []
    for seg in segments:
        fp = digest(fp, _step_fingerprint(seg.corpus) if seg.corpus else None,
                     [_step_fingerprint(s) for s in seg.steps])
        out.append(fp)
    return out


def fresh(directory: Path, fingerprint: str, clear: tuple[Path, ...] = ()) -> None:
    """Empty ``directory`` (and the ``clear`` directories that hold its results) unless it holds
    work of this fingerprint; the stamp is written last, so a crash leaves nothing stale."""
    stamp = directory / "FINGERPRINT"
    if stamp.exists() and stamp.read_text() == fingerprint:
        return
    for d in (*clear, directory):
        shutil.rmtree(d, ignore_errors=True)
    directory.mkdir(parents=True)
    stamp.write_text(fingerprint)


def seg_dir(job: Job, seg: int) -> Path:
    return Path(job.run_dir) / "work" / f"seg-{seg}"


def clean_leftovers(run_dir: Path, num_segments: int) -> None:
    """Remove what a killed run leaves behind: the temporary files and folders of writes it did
    not finish (in ``work/``, ``output/``, ``rejects/`` and the run folder itself), and the work
    folders of segments beyond ``num_segments`` (a recipe that now has fewer corpus steps).

    Every such write belongs to a run of this folder, and this runs before any task starts,
    so every temporary sibling found is stale.
    """
    work = run_dir / "work"
    for d in work.glob("seg-*"):
        if re.fullmatch(r"seg-\d+", d.name) and int(d.name[4:]) >= num_segments and d.is_dir():
            shutil.rmtree(d)
    temps = [p for p in run_dir.iterdir() if is_temporary(p)]
    for top in (work, run_dir / "output", run_dir / "rejects"):
        for root, dirs, files in os.walk(top):
            found = [Path(root) / name for name in dirs + files if is_temporary(Path(root) / name)]
            dirs[:] = [name for name in dirs if Path(root) / name not in found]  # removed whole, not walked
            temps += found
    for path in temps:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
