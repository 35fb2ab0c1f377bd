from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.scaling.counts import count_parameters
from lmforge.stages.pretrain import PretrainRecipe
from tests.scaling.planted import TRUE, isoflop_runs, law, write_csv

FAST = ["fit.grid_stride=2", "fit.bootstrap=8"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("scaling")
    csv = write_csv(tmp_path / "runs.csv", isoflop_runs(sizes=7, noise=0.002), flops=False)
    out = tmp_path / "scaling"
    assert main(["scaling", "fit", str(csv), f"out={out}", *FAST]) == 0
    return out


def test_fit_writes_json_markdown_and_plots_with_all_three_approaches(fitted):
    s = json.loads((fitted / "fit.json").read_text())
    assert set(s["exponents"]) == {"approach_1", "approach_2", "approach_3"}
    assert s["chinchilla"]["constants"]["alpha"]["estimate"] == pytest.approx(TRUE["alpha"], abs=0.02)
    assert len(s["chinchilla"]["bootstrap"]) == 8 and s["chinchilla"]["r2"] > 0.99
    assert s["agree"] is True
    assert {"residuals.png", "isoflops.png", "optimal.png"} <= {p.name for p in fitted.iterdir()}
    md = (fitted / "fit.md").read_text()
    assert "| alpha |" in md and "approach 2" in md


def test_fit_reads_training_curves_for_approach_1(tmp_path):
    csv = write_csv(tmp_path / "runs.csv", isoflop_runs(sizes=5))
    curves = tmp_path / "curves.csv"
    rows = ["run,step,params,tokens,flops,loss"]
    for i, n in enumerate(np.geomspace(1e7, 1e9, 8)):
        for step, d in enumerate(np.geomspace(1e8, 1e11, 30)):
            rows.append(f"r{i},{step},{n},{d},,{float(law(n, d))}")
    curves.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    assert main(["scaling", "fit", str(csv), f"fit.curves={curves}", f"out={out}", "fit.approaches=[1]"]) == 0
    s = json.loads((out / "fit.json").read_text())
    assert list(s["exponents"]) == ["approach_1"] and s["approach_1"]["frontier_points"] > 8
    assert not any("no training curves" in w for w in s["warnings"])


def test_plan_writes_a_pretrain_recipe_of_about_the_optimal_size(fitted, capsys):
    args = ["scaling", "plan", "recipes/demo/pretrain.yaml", f"out={fitted}", "budget.gpu=H100", "budget.count=8",
            "budget.hours=1", "budget.mfu=0.4"]
    assert main(args) == 0
    plan = json.loads((fitted / "plan.json").read_text())
    assert plan["budget_flops"] == pytest.approx(989e12 * 8 * 3600 * 0.4)
    opt = plan["compute_optimal"]
    assert opt["params_range"]["low"] <= opt["params"] <= opt["params_range"]["high"]
    recipe = load_config(PretrainRecipe, fitted / "pretrain.yaml")
    assert count_parameters(recipe.model).non_embedding == pytest.approx(opt["params"], rel=0.1)
    assert recipe.train.lr == pytest.approx(plan["hyperparameters"]["lr"])
    assert recipe.train.max_steps * recipe.train.batch_tokens >= opt["tokens"]
    assert "compute-optimal" in capsys.readouterr().out


def test_plan_with_inference_and_scarce_data_adds_both_alternatives(fitted):
    assert main(["scaling", "plan", f"out={fitted}", "budget.flops=1e20", "plan.inference_tokens=1e12",
                 "plan.unique_tokens=1e9"]) == 0
    plan = json.loads((fitted / "plan.json").read_text())
    assert plan["overtrained"]["params"] < plan["compute_optimal"]["params"]
    assert plan["data_constrained"]["epochs"] > 1
    assert plan["recipe"]["follows"] == "data_constrained"


def test_flops_counts_a_recipe_and_its_time_at_an_mfu(tmp_path, capsys):
    assert main(["scaling", "flops", "recipes/demo/pretrain.yaml", f"out={tmp_path}", "budget.peak_flops=1e12",
                 "budget.mfu=0.5", "tokens=1e9"]) == 0
    r = json.loads((tmp_path / "flops.json").read_text())
    assert r["training_flops"] == pytest.approx(r["flops_per_token"]["total"] * 1e9)
    assert r["training_hours"] == pytest.approx(r["training_flops"] / 0.5e12 / 3600)
    assert r["memory"]["without_ac"]["total"] > r["memory"]["with_ac"]["total"] > 0
    assert "non-embedding" in capsys.readouterr().out


def test_bad_input_is_one_line_naming_the_file_line_and_column(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    csv.write_text("run,params,tokens,loss\na,1e6,0,3.0\n")
    assert main(["scaling", "fit", str(csv), f"out={tmp_path}"]) == 2
    assert "runs.csv:2: column 'tokens' = '0'" in capsys.readouterr().err


def test_plan_without_a_budget_says_what_it_needs(fitted, capsys):
    assert main(["scaling", "plan", f"out={fitted}"]) == 2
    assert "budget.flops" in capsys.readouterr().err


def test_an_unknown_gpu_lists_the_data_sheet_ones(fitted, capsys):
    assert main(["scaling", "plan", f"out={fitted}", "budget.gpu=TPU", "budget.hours=1"]) == 2
    assert "H100" in capsys.readouterr().err


def test_without_bootstrap_the_outputs_are_strict_json_and_the_plan_has_no_interval(tmp_path):
    csv = write_csv(tmp_path / "runs.csv", isoflop_runs(sizes=5))
    out = tmp_path / "out"
    assert main(["scaling", "fit", str(csv), f"out={out}", "fit.bootstrap=0", "fit.grid_stride=2",
                 "fit.approaches=[3]"]) == 0
    assert main(["scaling", "plan", f"out={out}", "budget.flops=1e20"]) == 0

    def refuse(name):
        raise ValueError(f"{name} in strict JSON")

    fit = json.loads((out / "fit.json").read_text(), parse_constant=refuse)
    plan = json.loads((out / "plan.json").read_text(), parse_constant=refuse)
    assert fit["chinchilla"]["constants"]["alpha"]["se"] is None
    assert plan["compute_optimal"]["params_range"] == {"low": None, "high": None}


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def bad_fit_inputs(tmp_path) -> dict:
    """Each case: the fit's arguments and the start of its one-line error."""
    runs = write_csv(tmp_path / "runs.csv", isoflop_runs(sizes=5))
    lines = runs.read_text().splitlines()
    big = tmp_path / "big.csv"
    big.write_text("\n".join(lines[:2] + [lines[2].replace(lines[2].split(",")[1], "1e300", 1)] + lines[3:]) + "\n")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    return {
        "params=1e300": ([str(big)], rf"{big}:3: column 'params' = '1e300' is outside 1 to 1e\+16 parameters"),
        "binary runs": ([str(binary)], rf"{binary}:2: not UTF-8 text \(byte 0x80\)"),
        "binary curves": ([str(runs), f"fit.curves={binary}"], rf"{binary}:2: not UTF-8 text \(byte 0x80\)"),
        "exclude_highest": ([str(runs), "fit.exclude_highest=100"], r"fit.exclude_highest = 100 leaves out all 20 runs"),
        "out a file": ([str(runs), f"out={runs}"], rf"out = {runs}: exists and is not a folder"),
    }


@pytest.mark.parametrize("case", ["params=1e300", "binary runs", "binary curves", "exclude_highest", "out a file"])
def test_bad_fit_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    args, message = bad_fit_inputs(tmp_path)[case]
    out = [] if any(a.startswith("out=") for a in args) else [f"out={tmp_path / 'out'}"]
    assert main(["scaling", "fit", *args, *out, *FAST]) == 2
    assert re.search(message, error_line(capsys))
    assert not (tmp_path / "out" / "fit.json").exists()


def test_a_budget_far_beyond_the_fit_warns_how_far(fitted, tmp_path, caplog):
    out = tmp_path / "plan"
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        assert main(["scaling", "plan", f"out={out}", f"plan.fit={fitted / 'fit.json'}", "budget.flops=1e30"]) == 0
    warning = r"budget.flops = 1e\+30 FLOPs is 9.0 decades above the largest compute in the fit \(1e\+21 FLOPs"
    assert re.search(warning, caplog.text)
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["warnings"]) == 1 and re.search(warning, plan["warnings"][0])
    assert "## Warnings" in (out / "plan.md").read_text()


def test_a_budget_inside_the_fit_has_no_warning(fitted, tmp_path):
    out = tmp_path / "plan"
    assert main(["scaling", "plan", f"out={out}", f"plan.fit={fitted / 'fit.json'}", "budget.flops=1e20"]) == 0
    assert json.loads((out / "plan.json").read_text())["warnings"] == []


@pytest.mark.parametrize(("args", "message"), [
    (["budget.flops=1e300"], r"^lmforge scaling: error: budget.flops = 1e\+300 FLOPs is beyond the 1e\+36"),
    (["budget.flops=1e35"], r"budget.flops = 1e\+35 FLOPs: the compute-optimal plan has N = \S+ parameters .*beyond "
                            r"the 1e\+15 parameters"),
    (["budget.flops=1e-300"], r"budget.flops = 1e-300 FLOPs: the compute-optimal plan .*under one parameter"),
    (["budget.peak_flops=1e300", "budget.count=1000000", "budget.hours=1e10"], r"is not a finite number of FLOPs"),
    (["budget.flops=1e20", "plan.inference_tokens=1e300"], r"plan.inference_tokens = 1e\+300 is beyond"),
])
def test_a_plan_no_recipe_can_hold_is_refused_naming_the_key(fitted, tmp_path, capsys, args, message):
    out = tmp_path / "plan"
    assert main(["scaling", "plan", f"out={out}", f"plan.fit={fitted / 'fit.json'}", *args]) == 2
    assert re.search(message, error_line(capsys))
    assert not (out / "pretrain.yaml").exists()


def test_a_fit_json_without_the_law_s_numbers_is_one_line(tmp_path, capsys):
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"chinchilla": {"params": {"log_A": 1.0}}}))
    assert main(["scaling", "plan", f"out={tmp_path}", "budget.flops=1e20"]) == 2
    assert re.search(rf"{fit}: not a fit.json of `lmforge scaling fit`.*KeyError", error_line(capsys))


@pytest.mark.parametrize("what", ["plan", "flops"])
def test_an_out_that_is_a_file_is_refused_before_any_work(fitted, tmp_path, capsys, what):
    taken = tmp_path / "taken"
    taken.write_text("")
    args = [f"plan.fit={fitted / 'fit.json'}", "budget.flops=1e20"] if what == "plan" else ["tokens=1e9"]
    assert main(["scaling", what, "recipes/demo/pretrain.yaml", f"out={taken}", *args]) == 2
    assert re.search(rf"out = {taken}: exists and is not a folder", error_line(capsys))


def test_plan_without_a_fit_says_to_fit_first(tmp_path, capsys):
    assert main(["scaling", "plan", f"out={tmp_path}", "budget.flops=1e20"]) == 2
    assert error_line(capsys) == (f"lmforge scaling: error: {tmp_path / 'fit.json'}: not found; run `lmforge scaling "
                                  "fit` first (or set plan.fit to a fit.json it wrote)")


def test_a_fit_through_the_cli_imports_neither_torch_nor_the_training_code(tmp_path):
    csv = write_csv(tmp_path / "runs.csv", isoflop_runs(sizes=5))
    code = ("import sys\nfrom lmforge.cli.main import main\n"
            f"assert main(['scaling', 'fit', {str(csv)!r}, 'out={tmp_path / 'out'}', 'fit.approaches=[2]']) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'lmforge.train', "
            "'lmforge.stages.pretrain'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "fit.json").is_file()
