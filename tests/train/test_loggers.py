"""train.loggers: W&B (offline) and MLflow (a file store) get the scalars, the config and the plots,
read back from what each wrote."""

import json
import struct
import time
from pathlib import Path

import pytest
import yaml

from lmforge.core.config import ConfigError, load_config
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.loggers import RUNS_FILE, flat_params
from lmforge.train.metrics import MetricsLogger, loss_curve_lines, read_metrics, scalars

# 4 steps, validated and checkpointed every 2; the first run stops at step 2, the second resumes it
STOPPED = {"train.max_steps": 4, "train.eval_every": 2, "train.checkpoint_every": 2, "train.stop_at_step": 2}
RESUMED = {"train.max_steps": 4, "train.eval_every": 2, "train.checkpoint_every": 2}


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch, tmp_path):
    """No user setting reaches the trackers, and nothing is written outside ``tmp_path``."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def train_stopped_then_resumed(make_recipe, logger: str, tmp_path: Path) -> tuple[Path, list[dict], Path]:
    """A 4-step pre-training run that stops at step 2 and is resumed, then its report's loss plot:
    the run directory, its metrics.jsonl records and the plot."""
    run_pretrain(make_recipe(**STOPPED, **{"train.loggers": f"[{logger}]"}))
    run_pretrain(make_recipe(**RESUMED, **{"train.loggers": f"[{logger}]"}))
    run_dir, plot = tmp_path / "run", tmp_path / "pretrain-loss.png"
    assert loss_curve_lines(run_dir, plot)
    return run_dir, read_metrics(run_dir), plot


def history(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


# --------------------------------------------------------------------------- MLflow


def test_mlflow_run_holds_the_scalars_config_and_plot_and_a_resumed_run_continues_it(make_recipe, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir, records, plot = train_stopped_then_resumed(make_recipe, "mlflow", tmp_path)
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("lmforge").experiment_id])
    assert [r.info.run_id for r in runs] == [json.loads((run_dir / RUNS_FILE).read_text())["mlflow"]]
    run_id = runs[0].info.run_id
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "time/forward_backward_s"):
        logged = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert sorted(logged) == history(records, key), key
    # the same scalars TensorBoard gets, no more
    assert set(client.get_run(run_id).data.metrics) == {k for r in records for k in scalars(r)}
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    # params keep the values first logged (MLflow refuses a change); config.yaml is the resumed run's
    assert client.get_run(run_id).data.params == {**flat_params(config), "train.stop_at_step": "2"}
    assert yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl"))).read_text()) == config
    assert [a.path for a in client.list_artifacts(run_id, "report")] == [f"report/{plot.name}"]
    assert Path(client.download_artifacts(run_id, f"report/{plot.name}", str(tmp_path / "dl"))).read_bytes() == plot.read_bytes()
    assert runs[0].info.status == "FINISHED"


def test_a_run_that_starts_over_starts_a_new_tracker_run_and_one_found_complete_opens_none(tmp_path):
    from mlflow.tracking import MlflowClient

    def logged_run(resume_step: int | None, records: list[dict]) -> str | None:
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step, loggers=["mlflow"],
                               config={"train": {"lr": 0.1}})
        for record in records:
            logger.log(record)
        logger.close()
        runs_file = tmp_path / RUNS_FILE
        return json.loads(runs_file.read_text())["mlflow"] if runs_file.exists() else None

    first = logged_run(None, [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    assert logged_run(2, []) == first  # already complete: the kept run is neither reopened nor replaced
    again = logged_run(None, [{"step": 1, "loss": 3.0}])
    assert again != first
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(first, "loss")] == [(1, 2.0), (2, 1.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(again, "loss")] == [(1, 3.0)]
    assert client.get_run(again).data.params == {"train.lr": "0.1"}
    assert logged_run(None, []) is None  # a fresh run without records forgets the old tracker runs


# --------------------------------------------------------------------------- W&B


def wandb_records(path: Path):
    """The records of an offline W&B run file (``run-<id>.wandb``): a LevelDB-style log (32 KiB blocks,
    each chunk a 7-byte header of CRC, length and type; the file opens with ``:W&B``, a magic and
    a version) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def finished_records(path: Path, timeout_s: float = 30.0) -> list:
    """The records of an offline run file once W&B's service has written all of it (its ``exit``
    record): ``run.finish()`` returns before the service has flushed the file."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(path))
        except DecodeError:  # a record cut by a write under way
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_wandb_offline_run_holds_the_scalars_config_and_plot_and_a_resumed_run_continues_it(make_recipe, tmp_path):
    run_dir, records, plot = train_stopped_then_resumed(make_recipe, "wandb", tmp_path)
    run_id = json.loads((run_dir / RUNS_FILE).read_text())["wandb"]
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 3  # the run to step 2, its resumption, the report's plot: one W&B run id
    rows, config, ids = {}, {}, set()
    for file in files:
        for record in finished_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                # an image's fields are nested under its key: "report/<name>/path", ...
                row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
                rows.setdefault(record.history.step.num, {}).update(row)
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    assert ids == {run_id}
    steps = [step for step in sorted(rows) if "loss" in rows[step]]
    assert steps == [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "val_loss", "time/forward_backward_s"):
        assert [(s, rows[s][key]) for s in steps if key in rows[s]] == history(records, key), key
    image_key = f"report/{plot.stem}/"
    logged = {k for s in steps for k in rows[s] if not k.startswith(("_", image_key))}
    assert logged == {k for r in records for k in scalars(r)}  # the same scalars TensorBoard gets
    expected = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {k: v for k, v in config.items() if k != "_wandb"} == expected
    image = {k.removeprefix(image_key): v for k, v in rows[4].items() if k.startswith(image_key)}
    assert image["_type"] == "image-file"  # at the run's last step
    assert (files[-1].parent / "files" / image["path"]).read_bytes() == plot.read_bytes()


# --------------------------------------------------------------------------- a missing package


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_logger_whose_package_is_missing_is_a_one_line_error_naming_its_extra(backend, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else real(name, *a))
    with pytest.raises(ConfigError) as error:
        load_config(PretrainRecipe, None, [f"run_dir={tmp_path / 'run'}", f"train.loggers=[{backend}]"])
    assert str(error.value) == f"train.loggers: {backend} is not installed; pip install 'lmforge[{backend}]'"
    assert not (tmp_path / "run").exists()
