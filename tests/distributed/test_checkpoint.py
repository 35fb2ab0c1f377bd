"""Sharded (DCP) checkpoints are read without unpickling anything but DCP's own metadata records
and plain values: a crafted ``.metadata`` or shard value runs nothing on any load path
(generate, export, resume), while a genuine sharded checkpoint still loads and resumes."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lmforge.checkpoints.files import write_checksums
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.io import InputError
from lmforge.distributed.checkpoint import read_model_state, save_sharded, sharded_state
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.optim import build_adamw


class RunsCommand:
    """A pickle that runs a shell command when loaded (what a crafted checkpoint would carry)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def rewrite_checksums(ckpt) -> None:
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)  # whoever crafts a checkpoint can do this too


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, recipe_for):
    """A 4-step run whose checkpoint is turned into a distributed run's: DCP shards, no safetensors."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    run_pretrain(recipe_for(run, **{"train.max_steps": 4}))
    ckpt = run / "checkpoints" / "step_00000004"
    model, _ = load_model(ckpt)
    optimizer = build_adamw(model, 3e-3, (0.9, 0.95), 1e-8, 0.1)
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    save_sharded(ckpt, model, optimizer)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "optimizer.pt").unlink()
    rewrite_checksums(ckpt)
    return run


@pytest.fixture()
def run_copy(sharded_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(sharded_run, copy)
    return copy


def test_a_genuine_sharded_checkpoint_loads_and_resumes_in_one_process(run_copy, recipe_for):
    ckpt = run_copy / "checkpoints" / "step_00000004"
    model, used = load_model(run_copy)
    assert used == ckpt
    assert all(torch.equal(model.state_dict()[k], v) for k, v in read_model_state(ckpt).items())
    summary = run_pretrain(recipe_for(run_copy, **{"train.max_steps": 6}))
    assert summary["start_step"] == 4 and summary["step"] == 6


def test_a_crafted_sharded_metadata_runs_nothing_on_any_load_path(run_copy, recipe_for, tmp_path):
    ckpt = run_copy / "checkpoints" / "step_00000004"
    probe, marker = tmp_path / "probe", tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {probe}")))
    with pytest.raises(AttributeError):  # os.system's exit status is no Metadata
        FileSystemReader(str(ckpt)).read_metadata()  # torch's own reader runs it: the payload works
    assert probe.exists()
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    rewrite_checksums(ckpt)

    with pytest.raises(InputError, match=r"\.metadata: not the metadata of a sharded checkpoint lmforge can read safely"):
        load_model(ckpt)
    assert main(["generate", f"checkpoint={ckpt}", "max_new_tokens=2", "device=cpu"]) != 0
    with pytest.raises(InputError, match="can read safely"):
        run_export(ExportRecipe(checkpoint=str(ckpt), run_dir=str(tmp_path / "hf")))
    with pytest.raises(InputError, match="can read safely"):
        run_pretrain(recipe_for(run_copy, **{"train.max_steps": 6, "train.resume": str(ckpt)}))
    assert not marker.exists()


def test_a_crafted_value_among_the_shards_runs_nothing_on_resume(run_copy, recipe_for, tmp_path):
    ckpt = run_copy / "checkpoints" / "step_00000004"
    marker = tmp_path / "marker"
    model, _ = load_model(ckpt)
    optimizer = build_adamw(model, 3e-3, (0.9, 0.95), 1e-8, 0.1)
    state = sharded_state(model, optimizer)
    [lr_key, *_] = [k for k in state["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr")]
    state["optimizer"][lr_key] = RunsCommand(f"touch {marker}")
    for path in ckpt.iterdir():
        if path.name == ".metadata" or path.suffix == ".distcp":
            path.unlink()
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(ckpt))
    rewrite_checksums(ckpt)
    with pytest.raises(InputError, match=rf"{lr_key}: refused, not a plain value"):
        run_pretrain(recipe_for(run_copy, **{"train.max_steps": 6}))
    assert not marker.exists()


def test_a_sharded_metadata_naming_a_shard_outside_the_checkpoint_is_refused(run_copy):
    ckpt = run_copy / "checkpoints" / "step_00000004"
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/hostname"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(InputError, match="outside the checkpoint directory"):
        read_model_state(ckpt)


@pytest.fixture()
def one_rank_group():
    """A process group of this process alone: the distributed loop runs in the test process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_background_checkpoint_is_committed_once_its_shards_are_written_not_at_the_next_one(
        one_rank_group, recipe_for, tmp_path, monkeypatch):
    from concurrent.futures import Future

    import lmforge.train.checkpoint as train_checkpoint
    from lmforge.checkpoints.files import verify_checksums
    from lmforge.data.shards import read_manifest
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.stages.pretrain import run_pretrain_distributed
    from lmforge.train.step import StepRunner

    def written_save(directory, model, optimizer, async_group=None):  # a background save that has finished
        save_sharded(directory, model, optimizer)
        done = Future()
        done.set_result(None)
        return done if async_group is not None else None

    real_step, steps = StepRunner.run_step, []

    def crash_at_step_3(*args, **kwargs):
        steps.append(None)
        if len(steps) == 3:
            raise KeyboardInterrupt("killed")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_sharded", written_save)
    monkeypatch.setattr(StepRunner, "run_step", crash_at_step_3)
    recipe = recipe_for(tmp_path / "run", **{"train.max_steps": 6, "train.checkpoint_every": 2,
                                             "parallel.async_checkpoint": True})
    with pytest.raises(KeyboardInterrupt):
        run_pretrain_distributed(recipe, Tokenizer.load(recipe.tokenizer),
                                 [read_manifest(d.path) for d in recipe.data.datasets])
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == ["step_00000002"]  # committed, no temporary directory left
    verify_checksums(ckpts / "step_00000002")
