"""`lmforge sft` with `dp:` (DP-SGD): the ε spent in metrics.jsonl, the summary and the report;
the budget stops (or warns about) the step that would exceed it; an interrupted run resumes to the
weights and ε of an uninterrupted one; bad DP input is one line naming the key, exit 2, nothing written."""

import json
import math

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.core.io import InputError
from lmforge.data.sft_demo import write_demo
from lmforge.stages.sft import SFTRecipe, report, run_sft
from lmforge.train.dp import epsilon_spent
from lmforge.train.metrics import read_metrics


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_dp_data")
    write_demo(path, 120, seed=0, val_fraction=0.1)
    return path


def overrides(run_dir, base, data, *more) -> list[str]:
    return [f"run_dir={run_dir}", f"checkpoint={base}", f"data.train=[{data / 'train.jsonl'}]",
            f"data.val=[{data / 'val.jsonl'}]", "data.max_length=128", "data.packing=false", "train.max_steps=6",
            "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4", "train.precision=fp32",
            "train.eval_every=3", "train.eval_batches=2", "train.tensorboard=false", "train.device=cpu",
            "train.checkpoint_every=3", "dp.delta=1e-3", *more]


def recipe(run_dir, base, data, *more) -> SFTRecipe:
    return load_config(SFTRecipe, None, overrides(run_dir, base, data, *more))


def test_dp_sft_reports_the_epsilon_spent_in_metrics_summary_and_report(tmp_path, base_checkpoint, sft_data):
    summary = run_sft(recipe(tmp_path / "run", base_checkpoint, sft_data, "dp.epsilon=8", "lora={r: 4, alpha: 8}"))
    dp = summary["dp"]
    n = dp["n_examples"]
    assert dp["steps"] == 6 and dp["expected_batch"] == 4 and math.isclose(dp["sample_rate"], 4 / n)
    eps = epsilon_spent("rdp", dp["noise_multiplier"], 4 / n, 6, 1e-3)
    assert 8 - 0.01 <= eps <= 8 and math.isclose(dp["epsilon"], eps, rel_tol=1e-9)  # σ chosen for the budget
    records = read_metrics(tmp_path / "run")
    spent = [r["dp/epsilon"] for r in records]
    assert spent == sorted(spent) and math.isclose(spent[-1], eps, rel_tol=1e-9)
    assert len({r["dp/batch_rows"] for r in records}) > 1  # Poisson: the batch's size varies
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["dp"]["epsilon"] == dp["epsilon"]
    line = "\n".join(report(summary, tmp_path / "run", tmp_path / "plot.png"))
    assert f"- DP-SGD: **(ε = {eps:.3g} of the budget 8, δ = 0.001)** after 6 steps (rdp accountant)" in line


@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_the_budget_stops_training_before_the_step_that_would_exceed_it_or_warns(tmp_path, base_checkpoint, sft_data,
                                                                                 policy, caplog):
    """σ = 0.8 at q = 4/N (N = 114) spends ε = 1.4 within a few of the 6 steps."""
    summary = run_sft(recipe(tmp_path / "run", base_checkpoint, sft_data, "dp.epsilon=1.4", "dp.noise_multiplier=0.8",
                             f"dp.on_budget_exceeded={policy}"))
    dp = summary["dp"]
    q = dp["sample_rate"]
    if policy == "stop":
        assert 0 < dp["steps"] < 6 and summary["step"] == dp["steps"] and dp["budget_exhausted"]
        assert dp["epsilon"] <= 1.4 < epsilon_spent("rdp", 0.8, q, dp["steps"] + 1, 1e-3)
        assert (tmp_path / "run" / "checkpoints" / f"step_{dp['steps']:08d}").is_dir()  # where it stopped
        with pytest.raises(InputError, match=r"dp: this run has spent its privacy budget"):  # a rerun takes no step
            run_sft(recipe(tmp_path / "run", base_checkpoint, sft_data, "dp.epsilon=1.4", "dp.noise_multiplier=0.8"))
    else:
        assert dp["steps"] == 6 and dp["epsilon"] > 1.4
        assert "spends more than dp.epsilon = 1.4 (dp.on_budget_exceeded=warn)" in caplog.text


def test_an_interrupted_dp_run_resumes_to_the_weights_and_epsilon_of_an_uninterrupted_one(tmp_path, base_checkpoint,
                                                                                          sft_data):
    whole = run_sft(recipe(tmp_path / "whole", base_checkpoint, sft_data, "dp.epsilon=4"))
    first = run_sft(recipe(tmp_path / "split", base_checkpoint, sft_data, "dp.epsilon=4", "train.stop_at_step=3"))
    assert first["dp"]["steps"] == 3
    resumed = run_sft(recipe(tmp_path / "split", base_checkpoint, sft_data, "dp.epsilon=4"))
    assert resumed["start_step"] == 3 and resumed["dp"]["steps"] == 6
    assert resumed["dp"]["epsilon"] == whole["dp"]["epsilon"]
    a, _ = load_model(tmp_path / "whole")
    b, _ = load_model(tmp_path / "split")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    losses = [[r["loss"] for r in read_metrics(tmp_path / d)] for d in ("whole", "split")]
    assert losses[0] == losses[1]


@pytest.mark.parametrize(("extra", "message"), [
    (["dp.epsilon=0"], "dp.epsilon"),
    (["dp.epsilon=-1"], "dp.epsilon"),
    (["dp.epsilon=1", "dp.delta=0.05"], "dp.delta = 0.05 is not below 1/N"),
    (["dp.epsilon=1", "data.packing=true"], "dp with data.packing=true"),
    (["dp.epsilon=1", "lora={r: 4, alpha: 8, quantize_base: nf4}"], "dp with lora.quantize_base=nf4"),
], ids=["epsilon-zero", "epsilon-negative", "delta-over-1/N", "packing", "quantised-base"])
def test_bad_dp_input_is_one_line_naming_the_key_exit_2_and_nothing_written(tmp_path, base_checkpoint, sft_data,
                                                                            extra, message, capsys):
    run_dir = tmp_path / "run"
    argv = overrides(run_dir, base_checkpoint, sft_data, *extra)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text("{}\n")
    assert main(["sft", str(recipe_file), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not run_dir.exists()
