"""The experiment trackers people use, beside ``metrics.jsonl`` and TensorBoard (``train.loggers``).

Weights & Biases writes an offline run into ``run_dir/wandb`` (unless ``WANDB_MODE`` says
otherwise: ``wandb sync`` uploads it later) and MLflow a file store in ``run_dir/mlruns``
(unless ``MLFLOW_TRACKING_URI`` names another). Each gets the scalars TensorBoard gets, the
resolved config (what ``config.yaml`` holds) and the report's plots. Each backend's run id is
kept in ``run_dir/loggers.json``: a resumed run, a rollback and the report after training
continue the same tracker run, and a run that starts over starts a new one.

A tracker run has no purge step as TensorBoard does: after a kill, the steps between the
checkpoint resumed from and the kill are logged twice (MLflow keeps both values, a synced W&B
run the first); ``metrics.jsonl`` stays the source of truth.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Protocol

from lmforge.core.config import ConfigError
from lmforge.core.io import InputError, atomic_write_json, read_json
from lmforge.core.run import log

LOGGERS = ("wandb", "mlflow")
MODULES = {"wandb": "wandb", "mlflow": "mlflow"}  # what each backend imports; its extra has the backend's name
RUNS_FILE = "loggers.json"  # {backend: run id} of the run directory's tracker runs


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def log_config(self, config: dict) -> None: ...
    def log_image(self, path: Path, step: int) -> None: ...
    def close(self) -> None: ...


def check_installed(names: list[str]) -> None:
    """A one-line ConfigError for the first backend of ``names`` whose package is missing, naming
    the extra that installs it (checked when the recipe is read, before any work)."""
    for name in names:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ConfigError(f"train.loggers: {name} is not installed; pip install 'lmforge[{name}]'")


class WandbTracker:
    """A W&B run in ``run_dir/wandb``: offline (no network) unless ``WANDB_MODE`` is set;
    ``WANDB_PROJECT`` names its project (default ``lmforge``)."""

    def __init__(self, run_dir: Path, run_id: str | None):
        import wandb

        self.wandb = wandb
        wait_for_a_new_second(run_dir / "wandb", run_id)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE") or "offline", dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT") or "lmforge", name=run_dir.name,
            id=run_id, resume="allow",  # no id: W&B makes one
            # console="off": the progress bar and log lines stay ours, not wrapped by wandb's capture
            settings=wandb.Settings(silent=True, console="off"))
        self.id = self.run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_image(self, path: Path, step: int) -> None:
        # a resumed online run's step is past the last one logged; W&B drops steps behind it
        self.run.log({f"report/{path.stem}": self.wandb.Image(str(path))}, step=max(step, self.run.step))

    def close(self) -> None:
        self.run.finish()


def wait_for_a_new_second(wandb_dir: Path, run_id: str | None) -> None:
    """W&B names a run's directory by the second it started in and its id: a run reopened within
    the second it was last opened in (the report, right after training) would write into the same
    directory, so this waits (under a second) for the next."""
    if run_id is None:
        return
    while any((wandb_dir / f"{mode}-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}").exists() for mode in ("run", "offline-run")):
        time.sleep(0.05)


# what MLflow accepts in a metric or param name; anything else becomes "_"
_MLFLOW_NAME = re.compile(r"[^\w./\- :]")
MLFLOW_PARAM_LENGTH = 6000  # MLflow refuses a longer param value


class MlflowTracker:
    """An MLflow run in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``lmforge``) of
    ``MLFLOW_TRACKING_URI``, else of a file store in ``run_dir/mlruns``."""

    def __init__(self, run_dir: Path, run_id: str | None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 asks for this opt-in before it opens a file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = run_id if run_id and self._exists(run_id) else self._create(run_dir.name)
        self.client.update_run(self.run_id, status="RUNNING")
        self.id = self.run_id

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _create(self, name: str) -> str:
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lmforge"
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        return self.client.create_run(experiment_id, run_name=name).info.run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", key), float(value), now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's most metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_config(self, config: dict) -> None:
        """The config as dotted params (kept as first logged: MLflow refuses to change a param, so
        a resumed run's changed keys are said in one line) and as ``config.yaml``."""
        import yaml
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = {_MLFLOW_NAME.sub("_", k)[:250]: v[:MLFLOW_PARAM_LENGTH] for k, v in flat_params(config).items()}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.info("mlflow: run %s keeps its first values of %s (params cannot change); config.yaml "
                     "holds the resumed config", self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(new), 100):  # MLflow's most params a batch
            self.client.log_batch(self.run_id, params=new[start:start + 100])
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False, allow_unicode=True), "config.yaml")

    def log_image(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="report")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{dotted key: text}``; a list is one value, as JSON."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def stored_runs(run_dir: Path) -> dict[str, str]:
    """``{backend: run id}`` of the tracker runs kept in ``run_dir`` (none without ``loggers.json``)."""
    path = Path(run_dir) / RUNS_FILE
    if not path.exists():
        return {}
    runs = read_json(path, "tracker run ids")
    if not isinstance(runs, dict):
        raise InputError(f"{path}: expected a mapping of backend to run id; delete it to start new tracker runs")
    return {k: v for k, v in runs.items() if k in TRACKERS and isinstance(v, str)}


def open_trackers(run_dir: Path, names: list[str], resume: bool) -> list[Tracker]:
    """The trackers of ``names`` for ``run_dir``; ``resume``: continue the runs kept there
    (``loggers.json``), else start new ones. The ids are kept for the next opening."""
    run_dir = Path(run_dir)
    runs = stored_runs(run_dir) if resume else {}
    trackers = [TRACKERS[name](run_dir, runs.get(name)) for name in names]
    atomic_write_json(run_dir / RUNS_FILE, {**runs, **{n: t.id for n, t in zip(names, trackers)}})
    return trackers


def forget_runs(run_dir: Path) -> None:
    """A run that starts over starts new tracker runs, and its report logs to none of the old ones."""
    (Path(run_dir) / RUNS_FILE).unlink(missing_ok=True)


def log_figures(run_dir: Path, paths: list[Path], step: int) -> None:
    """Log the report's plots ``paths`` of the training run in ``run_dir`` to the tracker runs it
    kept (those its ``train.loggers`` named); nothing when it kept none."""
    runs = stored_runs(run_dir) if paths else {}
    for name, run_id in runs.items():
        if importlib.util.find_spec(MODULES[name]) is None:
            log.warning("%s: the run logged to %s, which is no longer installed: its plots are not logged there "
                        "(pip install 'lmforge[%s]')", run_dir, name, name)
            continue
        tracker = TRACKERS[name](Path(run_dir), run_id)
        try:
            for path in paths:
                tracker.log_image(path, step)
        finally:
            tracker.close()
