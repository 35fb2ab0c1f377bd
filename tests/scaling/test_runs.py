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


HEADER = "run,step,params,tokens,flops,loss\n"


@pytest.mark.parametrize(("row", "message"), [
    ("b,0,1e300,1e7,,3.4", r"runs.csv:3: column 'params' = '1e300' is outside 1 to 1e\+16 parameters"),
    ("b,0,2e6,1e7,1e300,3.4", r"runs.csv:3: column 'flops' = '1e300' is outside 1 to 1e\+36 FLOPs"),
    ("b,0,2e6,1e300,,3.4", r"runs.csv:3: column 'tokens' = '1e300' is outside 1 to 1e\+18 tokens"),
    ("b,0,0.5,1e7,,3.4", r"runs.csv:3: column 'params' = '0.5' is outside 1 to"),
    ("b,0,2e6,1e7,,40000", r"runs.csv:3: column 'loss' = '40000' is outside 0 to 100 nats per token.*perplexity"),
    ("b,0,2e6,,6,3.4", r"runs.csv:3: tokens = flops / \(6 params\) = 5e-07 is outside 1 to 1e\+18 tokens"),
    ("b,0,nan,1e7,,3.4", r"runs.csv:3: column 'params' = 'nan'.*positive, finite"),
    ("b,0,2e6,inf,,3.4", r"runs.csv:3: column 'tokens' = 'inf'.*positive, finite"),
    ("b,0,2e6,1e7,,-3.4", r"runs.csv:3: column 'loss' = '-3.4'.*positive, finite"),
    ("b,0,0,1e7,,3.4", r"runs.csv:3: column 'params' = '0'.*positive, finite"),
    ("b,-1,2e6,1e7,,3.4", r"runs.csv:3: column 'step' = '-1': a step is a count from 0"),
    ("b,99999999999999999999999,2e6,1e7,,3.4", r"runs.csv:3: column 'step' = '9+': a step is a count from 0"),
])
def test_a_value_a_fit_cannot_take_is_refused_naming_its_line(tmp_path, row, message):
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "a,0,1e6,2e7,,3.5\n" + row + "\n")
    with pytest.raises(InputError, match=message):
        read_runs(path, curves=True)


def test_a_binary_file_is_refused_naming_the_line_of_its_first_bad_byte(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_bytes(HEADER.encode() + b"a,0,1e6,2e7,,3.5\n\xc2\x00\xff\n")
    with pytest.raises(InputError, match=r"runs.csv:3: not UTF-8 text \(byte 0xc2\)"):
        read_runs(path)


def test_a_row_the_csv_module_cannot_read_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "a,0,1e6,2e7,,3.5\n" + "b" * 200_000 + ",0,1e6,2e7,,3.5\n")
    with pytest.raises(InputError, match=r"runs.csv:3: not a readable CSV row \(field larger than field limit"):
        read_runs(path)


def test_a_spreadsheet_s_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_bytes(b"\xef\xbb\xbfrun,params,tokens,flops,loss\na,1e6,2e7,,3.5\n")
    assert read_runs(path).names == ["a"]


def test_a_line_is_the_file_s_line_when_a_quoted_name_spans_two(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text('run,params,tokens,flops,loss\n"a\nb",1e6,2e7,,3.5\nc,1e6,2e7,,-1\n')
    with pytest.raises(InputError, match=r"runs.csv:4: column 'loss' = '-1'"):
        read_runs(path)
