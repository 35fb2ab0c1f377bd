"""Checkpoint averaging during training (lmforge.train.ema, train.average)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lmforge.checkpoints.load import load_model
from lmforge.core.config import ConfigError
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.ema import AverageConfig, ModelAverage, build_average

pytestmark = pytest.mark.usefixtures("one_thread")


def _walk(model: nn.Linear, average: ModelAverage, values: list[float | None]) -> None:
    """Set the weights to each value in turn (as steps 1, 2, ... would) and fold them in."""
    for step, v in enumerate(values, start=1):
        if v is None:  # a step already taken
            continue
        with torch.no_grad():
            model.weight.fill_(v)
            model.bias.fill_(-v)
        average.update(step)


def test_the_ema_equals_its_closed_form_over_known_steps():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(-1.0)
    average = ModelAverage(model, AverageConfig(method="ema", decay=0.5), max_steps=10)
    _walk(model, average, [2.0, 4.0, 8.0])
    # θ̄_3 = β³θ_0 + (1 − β)(β²θ_1 + βθ_2 + θ_3) = 0.125 + 0.5·(0.5 + 2 + 8) = 5.375
    weight, bias = average.averaged()
    assert torch.equal(weight, torch.full((2, 3), 5.375)) and torch.equal(bias, torch.full((2,), -5.375))
    with average.swapped_in():
        assert torch.equal(model.weight, torch.full((2, 3), 5.375))
    assert torch.equal(model.weight, torch.full((2, 3), 8.0))  # its own weights back


def test_last_n_is_the_mean_of_the_last_n_steps_only():
    model = nn.Linear(3, 2)
    average = ModelAverage(model, AverageConfig(method="last_n", last_n=2), max_steps=5)
    _walk(model, average, [1.0, 2.0, 3.0])
    assert not average.ready()  # the window is steps 4 and 5
    _walk(model, average, [None, None, None, 10.0, 20.0])
    assert average.updates == 2 and torch.equal(average.averaged()[0], torch.full((2, 3), 15.0))


def test_a_window_longer_than_the_run_and_a_distributed_run_are_refused():
    with pytest.raises(ConfigError, match=r"train.average.last_n = 20 .*\(train.max_steps = 10\)"):
        ModelAverage(nn.Linear(2, 2), AverageConfig(method="last_n", last_n=20), max_steps=10)
    with pytest.raises(ConfigError, match="train.average keeps its average in one process"):
        build_average(AverageConfig(), nn.Linear(2, 2), 10, distributed=True)


def test_the_average_is_saved_beside_the_checkpoint_loadable_and_validated(make_recipe, tmp_path):
    summary = run_pretrain(make_recipe(**{"train.average": "{method: ema, decay: 0.9}"}))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000008"
    model, directory = load_model(ckpt / "average")  # what every verb that takes a checkpoint does
    assert directory == ckpt / "average"
    state = load_file(str(ckpt / "average.safetensors"))
    own = dict(model.named_parameters())
    assert all(torch.equal(own[name], value) for name, value in state.items())
    raw = load_model(ckpt)[0]
    assert not torch.equal(raw.embed.weight, model.embed.weight)
    assert summary["average/val_loss"] > 0 and summary["average/val_loss"] != summary["val_loss"]
    trainer = json.loads((ckpt / "trainer_state.json").read_text())
    assert trainer["average"] == {"method": "ema", "decay": 0.9, "last_n": 100, "updates": 8}


def test_resume_mid_run_keeps_the_average_exactly(make_recipe, tmp_path):
    average = {"train.average": "{method: last_n, last_n: 6}"}
    run_pretrain(make_recipe(tmp_path / "full", **average))
    run_pretrain(make_recipe(tmp_path / "half", **average, **{"train.stop_at_step": 4}))
    resumed = run_pretrain(make_recipe(tmp_path / "half", **average))
    assert resumed["start_step"] == 4
    full, half = (load_file(str(tmp_path / r / "checkpoints" / "step_00000008" / "average.safetensors"))
                  for r in ("full", "half"))
    assert full.keys() == half.keys() and all(torch.equal(full[k], half[k]) for k in full)
    first = load_file(str(tmp_path / "half" / "checkpoints" / "step_00000004" / "average.safetensors"))
    assert any(not torch.equal(first[k], full[k]) for k in full)  # the window (steps 3-8) was half-way at step 4


def test_both_averages_match_torchs_averaged_model_on_random_steps():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)  # torch's first update copies the weights: θ̄_0 = θ_0
    ours_ema = ModelAverage(model, AverageConfig(method="ema", decay=0.9), max_steps=6)
    swa = AveragedModel(model)  # torch's default: the running equal average of the updates it is given
    ours_window = ModelAverage(model, AverageConfig(method="last_n", last_n=3), max_steps=6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 7):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
        ours_ema.update(step)
        if step > 3:
            swa.update_parameters(model)
        ours_window.update(step)
    # float32 on both sides, the same operations in another order: a few ulps
    for theirs, mine in zip(ema.module.parameters(), ours_ema.averaged()):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)
    for theirs, mine in zip(swa.module.parameters(), ours_window.averaged()):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)
