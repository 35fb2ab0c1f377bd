from __future__ import annotations

import numpy as np
import pytest

from lmforge.core.io import InputError
from lmforge.scaling.parametric import CHINCHILLA, fit_law
from lmforge.scaling.runs import read_runs


def test_empty_flops_are_six_n_d_and_aliases_are_read(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run,N,D,C,loss\na,1e6,2e7,,3.5\nb,2e6,1e7,1.3e14,3.4\n")
    runs = read_runs(path)
    assert runs.names == ["a", "b"]
    assert runs.flops[0] == pytest.approx(6 * 1e6 * 2e7)
    assert runs.flops[1] == 1.3e14  # a measured count is kept as given
    assert runs.lines == [2, 3]


def test_tokens_are_derived_from_flops_when_missing(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("Model Size,Training FLOP,loss\n1e8,6e18,2.9\n")
    assert read_runs(path).tokens[0] == pytest.approx(1e10)


def test_a_missing_column_names_the_file_and_what_the_fit_needs(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run,params,flops\na,1e6,1e15\n")
    with pytest.raises(InputError, match=r"runs.csv:1: missing column\(s\) loss.*run,params,tokens,flops,loss"):
        read_runs(path)


def test_a_non_positive_value_names_the_line_and_column(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run,params,tokens,flops,loss\na,1e6,2e7,,3.5\nb,-2e6,1e7,,3.4\n")
    with pytest.raises(InputError, match=r"runs.csv:3: column 'params' = '-2e6'.*positive"):
        read_runs(path)


def test_a_non_number_names_the_line(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run,params,tokens,flops,loss\na,1e6,2e7,,abc\n")
    with pytest.raises(InputError, match=r"runs.csv:2: column 'loss' = 'abc' is not a number"):
        read_runs(path)


def test_fewer_points_than_parameters_is_an_error_that_says_how_many_are_needed(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run,params,tokens,flops,loss\n" + "".join(f"r{i},{1e6 * (i + 1)},1e8,,{3 - 0.1 * i}\n"
                                                                 for i in range(4)))
    with pytest.raises(InputError, match="4 point.*5 parameters.*at least 6 runs"):
        fit_law(CHINCHILLA, read_runs(path), bootstrap=0)


def test_curves_need_a_step_column(tmp_path):
    path = tmp_path / "curves.csv"
    path.write_text("run,params,tokens,flops,loss\na,1e6,2e7,,3.5\n")
    with pytest.raises(InputError, match="step"):
        read_runs(path, curves=True)
    path.write_text("run,step,params,tokens,flops,loss\na,0,1e6,2e7,,3.5\na,10,1e6,4e7,,3.2\n")
    assert np.array_equal(read_runs(path, curves=True).steps, [0, 10])
