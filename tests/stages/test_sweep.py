"""lmforge sweep: a grid of tiny pre-training runs, their CSVs, skipping, resuming, bad grids."""

import csv
import json
import shutil
import time

import pytest
import yaml

from lmforge.cli.main import main
from lmforge.core.config import ConfigError, apply_override, load_config
from lmforge.core.io import InputError
from lmforge.stages.sweep import SweepRecipe, build_grid, non_embedding_params, run_status, run_sweep
from lmforge.train.metrics import read_metrics
from tests.core.test_untrusted import BOMB
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (fixture of tests/train)

SIZES = [{"d_model": 32, "n_layers": 1}, {"name": "wide", "d_model": 48, "n_layers": 2, "n_heads": 4}]


@pytest.fixture()
def pretrain_yaml(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    """tests/train's tiny pretrain recipe as written in a file (4 windows of 32 tokens a micro-batch,
    2 micro-batches a step), evaluated every 2 steps."""
    data: dict = {}
    for item in tiny_pretrain_overrides(tmp_path / "unused", shards_dir, small_tokenizer_dir,
                                        **{"train.eval_every": 2, "train.checkpoint_every": 2}):
        apply_override(data, item)
    del data["run_dir"], data["model"]["ffn_hidden"]
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def sweep_recipe(tmp_path, pretrain_yaml, **overrides) -> SweepRecipe:
    values = {"run_dir": str(tmp_path / "sweep"), "pretrain": str(pretrain_yaml), "models": SIZES, **overrides}
    return load_config(SweepRecipe, None, [f"{k}={json.dumps(v)}" for k, v in values.items()])


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_an_isoflop_sweep_trains_each_point_for_its_budget_and_writes_the_csvs(tmp_path, pretrain_yaml):
    budget = 3e8
    result = run_sweep(sweep_recipe(tmp_path, pretrain_yaml, flops=[budget]))
    rows = read_csv(tmp_path / "sweep" / "runs.csv")
    assert [r["run"] for r in rows] == ["C3e8-d32-l1", "C3e8-wide"] == [r["run"] for r in result["runs"]]
    for row, grid_run in zip(rows, build_grid(sweep_recipe(tmp_path, pretrain_yaml, flops=[budget]))):
        run_dir = tmp_path / "sweep" / row["run"]
        summary = json.loads((run_dir / "summary.json").read_text())
        fpt = grid_run.recipe.model.flops_per_token(32)
        assert summary["step"] == grid_run.steps == round(budget / (fpt * 256))  # 256 tokens a step
        assert int(row["tokens"]) == 256 * grid_run.steps == summary["step"] * summary["tokens_per_step"]
        assert int(row["flops"]) == fpt * int(row["tokens"])
        assert abs(int(row["flops"]) - budget) <= fpt * 256 / 2  # within half a step of the budget
        assert int(row["params"]) == non_embedding_params(grid_run.recipe.model)
        assert float(row["loss"]) == summary["val_loss"]
    assert int(rows[0]["params"]) < int(rows[1]["params"]) and int(rows[0]["tokens"]) > int(rows[1]["tokens"])
    curves = read_csv(tmp_path / "sweep" / "curves.csv")
    first = [r for r in curves if r["run"] == rows[0]["run"]]
    records = [r for r in read_metrics(tmp_path / "sweep" / rows[0]["run"]) if "val_loss" in r]
    assert [(int(r["step"]), float(r["loss"])) for r in first] == [(r["step"], r["val_loss"]) for r in records]
    assert [int(r["step"]) for r in first][:2] == [2, 4]
    points = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [p["flops"] for p in points] == [int(r["flops"]) for r in rows] and points[0]["status"] == "finished"


def test_a_rerun_skips_finished_runs_and_resumes_interrupted_ones(tmp_path, pretrain_yaml):
    recipe = sweep_recipe(tmp_path, pretrain_yaml, grid="tokens", tokens=[1024], models=SIZES[:1])
    full = sweep_recipe(tmp_path / "full", pretrain_yaml, grid="tokens", tokens=[1024], models=SIZES[:1])
    run_sweep(full)
    stopped = sweep_recipe(tmp_path, pretrain_yaml, grid="tokens", tokens=[1024], models=SIZES[:1],
                           overrides=["train.stop_at_step=2"])
    with pytest.raises(InputError, match="stopped before their last step.*d32-l1-D1024"):
        run_sweep(stopped)  # the run stops at step 2 of 4, like a killed one
    assert read_csv(tmp_path / "sweep" / "runs.csv") == []
    run_sweep(recipe)  # resumes from step 2
    run_dir = tmp_path / "sweep" / "d32-l1-D1024"
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == 2
    assert [r["loss"] for r in read_metrics(run_dir)] == [r["loss"] for r in read_metrics(tmp_path / "full" / "sweep" / run_dir.name)]
    before = (run_dir / "metrics.jsonl").stat().st_mtime_ns
    run_sweep(recipe)  # finished: skipped
    assert (run_dir / "metrics.jsonl").stat().st_mtime_ns == before
    assert read_csv(tmp_path / "sweep" / "runs.csv") == read_csv(tmp_path / "full" / "sweep" / "runs.csv")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # the final checkpoint lost: trained again from step 2
    run_sweep(recipe)
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == 2
    assert read_csv(tmp_path / "sweep" / "runs.csv") == read_csv(tmp_path / "full" / "sweep" / "runs.csv")


def test_a_run_directory_of_another_recipe_is_refused(tmp_path, pretrain_yaml):
    run_sweep(sweep_recipe(tmp_path, pretrain_yaml, grid="tokens", tokens=[512], models=SIZES[:1]))
    changed = sweep_recipe(tmp_path, pretrain_yaml, grid="tokens", tokens=[512], models=SIZES[:1],
                           overrides=["train.lr=1e-3"])
    with pytest.raises(InputError, match="trained with another recipe.*train.lr"):
        run_sweep(changed)


def test_an_option_added_after_a_run_began_counts_as_its_default(tmp_path, pretrain_yaml):
    recipe = sweep_recipe(tmp_path, pretrain_yaml, grid="tokens", tokens=[512], models=SIZES[:1])
    run_sweep(recipe)
    config = next((tmp_path / "sweep").glob("d32-*")) / "config.yaml"
    stored = yaml.safe_load(config.read_text())
    assert stored["train"].pop("eval_tasks") == []  # as written by an lmforge without the option
    config.write_text(yaml.safe_dump(stored))
    before = (config.parent / "metrics.jsonl").stat().st_mtime_ns
    run_sweep(recipe)  # still the same recipe: finished, skipped
    assert (config.parent / "metrics.jsonl").stat().st_mtime_ns == before
    stored["train"]["eval_tasks"] = ["somewhere"]  # a real difference is still refused
    config.write_text(yaml.safe_dump(stored))
    with pytest.raises(InputError, match="trained with another recipe.*train.eval_tasks"):
        run_sweep(recipe)


def test_parallel_runs_in_their_own_processes_give_the_results_of_a_sequential_sweep(tmp_path, pretrain_yaml):
    kwargs = {"grid": "tokens", "tokens": [512], "overrides": ["train.eval_every=0"]}
    run_sweep(sweep_recipe(tmp_path / "seq", pretrain_yaml, **kwargs))
    run_sweep(sweep_recipe(tmp_path / "par", pretrain_yaml, max_parallel=2, **kwargs))
    seq, par = read_csv(tmp_path / "seq" / "sweep" / "runs.csv"), read_csv(tmp_path / "par" / "sweep" / "runs.csv")
    assert [(r["run"], r["params"], r["tokens"], r["flops"]) for r in par] == \
        [(r["run"], r["params"], r["tokens"], r["flops"]) for r in seq]
    assert [float(r["loss"]) for r in par] == pytest.approx([float(r["loss"]) for r in seq], rel=1e-4)
    assert (tmp_path / "par" / "sweep" / "logs" / f"{par[0]['run']}.log").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"models": [], "flops": [1e9]}, "models is empty"),
    ({"models": ["tiny", "tinny"], "flops": [1e9]}, r"models\[1\]: unknown model preset 'tinny'; choose one of tiny"),
    ({"flops": []}, "grid isoflop needs flops"),
    ({"flops": [1e9], "tokens": [100]}, "tokens is set but grid is isoflop"),
    ({"flops": [1e6]}, r"sweep run C1e6-d32-l1 .*buys 0.02 optimizer steps"),
    ({"grid": "tokens", "tokens": [100]}, r"sweep run d32-l1-D100 .*one step spends 256 tokens"),
    ({"models": [{"d_model": 32}, {"d_model": 32}], "flops": [1e9]}, "both named 'd32'"),
    ({"models": [{"dmodel": 32}], "flops": [1e9]}, "unknown key 'model.dmodel'; did you mean 'model.d_model'"),
    ({"flops": [1e9], "overrides": ["train.warmup_steps=50", "train.max_steps=100"]}, "fewer than train.warmup_steps = 50"),
])
def test_a_bad_grid_is_a_clear_error(tmp_path, pretrain_yaml, overrides, message):
    with pytest.raises((InputError, ValueError), match=message):
        build_grid(sweep_recipe(tmp_path, pretrain_yaml, **overrides))


def test_warmup_fraction_scales_warm_up_with_each_run(tmp_path, pretrain_yaml):
    runs = build_grid(sweep_recipe(tmp_path, pretrain_yaml, flops=[3e8], warmup_fraction=0.5))
    assert [r.recipe.train.warmup_steps for r in runs] == [round(r.steps / 2) for r in runs]


def test_the_cpu_isoflop_recipe_is_three_budgets_by_five_sizes(monkeypatch):
    from pathlib import Path

    import lmforge.stages.sweep as sweep

    monkeypatch.setattr(sweep, "check_validation_split", lambda recipe: None)  # the demo's shards are not built here
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    runs = build_grid(load_config(SweepRecipe, "recipes/scaling/cpu_isoflop.yaml"))
    assert len(runs) == 15 and len({r.name for r in runs}) == 15
    for run in runs:
        assert run.flops == pytest.approx(run.budget["flops"], rel=0.02)
        assert run.recipe.train.max_steps == run.steps and not run.recipe.train.compile


@pytest.mark.parametrize(("overrides", "message"), [
    ({"grid": "tokens", "tokens": [5120, 5120]}, r"^sweep tokens\[1\] = 5120 repeats tokens\[0\]"),
    ({"flops": [3e8, 3e8, 1e9]}, r"^sweep flops\[1\] = 3e\+08 repeats flops\[0\]"),
    # 5120 and 5130 tokens are both 20 steps of 256 tokens: two names, one run
    ({"grid": "tokens", "tokens": [5120, 5130]}, r"tokens\[1\] = 5130 \(models entry 'd32-l1'\) resolves to the "
                                                 r"same run as d32-l1-D5120 \(tokens\[0\] = 5120, 20 steps\)"),
    # two budgets written differently that name one run directory
    ({"grid": "tokens", "tokens": [10000.1, 10000.2]}, r"tokens\[1\] = 10000.2 .*names the run directory d32-l1-D1e4"),
    ({"grid": "tokens", "tokens": [5120], "models": [SIZES[0], {"name": "again", **SIZES[0]}]},
     r"tokens\[0\] = 5120 \(models entry 'again'\) resolves to the same run as d32-l1-D5120"),
])
def test_a_grid_point_repeated_is_refused_before_any_run(tmp_path, pretrain_yaml, overrides, message):
    with pytest.raises(InputError, match=message):
        build_grid(sweep_recipe(tmp_path, pretrain_yaml, **overrides))


def test_a_repeated_grid_point_exits_2_with_one_line_and_trains_nothing(tmp_path, pretrain_yaml, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "sweep"), "pretrain": str(pretrain_yaml),
                                    "models": SIZES, "grid": "tokens", "tokens": [5120, 5120], "max_parallel": 2}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokens[1] = 5120 repeats tokens[0]" in err[0]
    assert not (tmp_path / "sweep").exists()


def test_a_model_name_that_is_a_path_is_refused_naming_the_key(tmp_path, pretrain_yaml):
    with pytest.raises(InputError, match=r"sweep models\[0\]\.name = '\.\./\.\./x' contains a path separator"):
        build_grid(sweep_recipe(tmp_path, pretrain_yaml, flops=[3e8], models=[{"name": "../../x", "d_model": 32}]))
    assert not (tmp_path.parent / "x").exists()


def test_an_alias_bomb_in_the_pretrain_recipe_is_refused_quickly(tmp_path, pretrain_yaml):
    pretrain_yaml.write_text(BOMB)
    start = time.perf_counter()
    with pytest.raises((InputError, ConfigError), match=r"pretrain\.yaml:\d+:\d+: aliases expand"):
        build_grid(sweep_recipe(tmp_path, pretrain_yaml, flops=[3e8]))
    assert time.perf_counter() - start < 5


def test_an_alias_bomb_in_a_run_directory_config_is_refused_quickly(tmp_path, pretrain_yaml):
    run = build_grid(sweep_recipe(tmp_path, pretrain_yaml, flops=[3e8]))[0]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.yaml").write_text(BOMB)
    start = time.perf_counter()
    with pytest.raises(InputError, match=rf"{run.name}/config\.yaml:\d+:\d+: aliases expand"):
        run_status(run)
    assert time.perf_counter() - start < 5


def test_a_run_dir_that_is_a_file_is_refused_before_any_run(tmp_path, pretrain_yaml):
    (tmp_path / "sweep").write_text("not a folder")
    with pytest.raises(InputError, match=r"^run_dir = .*sweep: exists and is not a folder"):
        run_sweep(sweep_recipe(tmp_path, pretrain_yaml, flops=[3e8]))
