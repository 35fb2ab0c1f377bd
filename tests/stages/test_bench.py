import dataclasses
import json
import re

import pytest
import torch

from lmforge.cli.main import main
from lmforge.stages import bench
from lmforge.stages.bench import BenchRecipe
from lmforge.train import metrics
from lmforge.train.metrics import datasheet_peak, machine_key, peak_cache_path, peak_flops, store_peak

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # a device object needs no GPU; its name is mocked below


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(metrics.PEAK_ENV)  # the suite's fixed peaks (tests/conftest.py) would answer first
    return tmp_path / "cache"


@pytest.fixture()
def h100(monkeypatch):
    """This machine plays an H100: bench resolves ``device=cuda`` to GPU, whose name is the H100's."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(bench, "resolve_device", lambda name: GPU)


def measurements(monkeypatch, *values):
    """Make bench's matmul timing return ``values`` in turn (and fail if called once more)."""
    queue = list(values)
    monkeypatch.setattr(bench, "measure_matmul_peak", lambda device, dtype, n, seconds: queue.pop(0))
    return queue


def test_measuring_a_cpu_writes_the_cache_that_mfu_then_uses(empty_cache):
    assert peak_flops(CPU, torch.float32, measure_if_missing=False) is None
    result = bench.run(BenchRecipe(device="cpu", dtypes=["float32"], size=64, seconds=0.05))
    cache = json.loads((empty_cache / "peak_flops.json").read_text())
    assert peak_cache_path() == empty_cache / "peak_flops.json"
    assert cache == {machine_key(CPU): {"float32": result["float32"]}} and result["float32"] > 0
    assert peak_flops(CPU, torch.float32, measure_if_missing=False) == result["float32"]


def test_a_second_measurement_keeps_the_higher_figure(monkeypatch):
    measurements(monkeypatch, 100e9, 50e9, 200e9)
    recipe = BenchRecipe(device="cpu", dtypes=["float32"])
    assert bench.run(recipe) == {"float32": 100e9}
    assert bench.run(recipe) == {"float32": 100e9}  # a busier rerun measures less: the peak stays
    assert peak_flops(CPU, torch.float32, measure_if_missing=False) == 100e9
    assert bench.run(recipe) == {"float32": 200e9}
    assert peak_flops(CPU, torch.float32, measure_if_missing=False) == 200e9


def test_a_known_gpu_uses_its_data_sheet_peak(h100, monkeypatch):
    assert datasheet_peak(GPU, "bfloat16") == 989e12 and datasheet_peak(GPU, "float32") == 67e12
    assert datasheet_peak(CPU, "bfloat16") is None
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: pytest.fail("a known GPU is not timed"))
    assert peak_flops(GPU, torch.bfloat16) == 989e12


def test_an_unknown_gpu_has_no_data_sheet_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future Accelerator")
    assert datasheet_peak(GPU, "bfloat16") is None
    assert peak_flops(GPU, torch.bfloat16, measure_if_missing=False) is None


def test_bench_on_a_known_gpu_reports_the_data_sheet_without_measuring_or_caching(h100, monkeypatch, empty_cache):
    measurements(monkeypatch)  # any timing would pop from an empty list
    assert bench.run(BenchRecipe(device="cuda", dtypes=["bfloat16", "float32"])) == {"bfloat16": 989e12,
                                                                                     "float32": 67e12}
    assert not (empty_cache / "peak_flops.json").exists()


def test_bench_measure_true_on_a_known_gpu_caches_the_measurement_and_mfu_uses_it(h100, monkeypatch):
    measurements(monkeypatch, 700e12)
    assert bench.run(BenchRecipe(device="cuda", dtypes=["bfloat16"], measure=True)) == {"bfloat16": 700e12}
    assert peak_flops(GPU, torch.bfloat16) == 700e12  # the measurement, not the data sheet's 989e12
    assert peak_flops(GPU, torch.float16) == 989e12  # a dtype not measured still comes from the data sheet
    measurements(monkeypatch)
    assert bench.run(BenchRecipe(device="cuda", dtypes=["bfloat16"])) == {"bfloat16": 700e12}


@pytest.mark.parametrize("dtypes, message", [
    (["foo"], "unknown dtype 'foo'; choose from float32, bfloat16, float16"),
    (["int8"], "unknown dtype 'int8'; choose from float32, bfloat16, float16"),
    ([], "dtypes is empty: give one or more of float32, bfloat16, float16"),
])
def test_bad_dtypes_are_rejected_naming_the_allowed_ones(dtypes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BenchRecipe(dtypes=dtypes)


@pytest.mark.parametrize("override", ["dtypes=[foo]", "dtypes=[]", "dtypes=[int8]", "seconds=0"])
def test_bad_bench_settings_are_one_line_errors_with_exit_code_2(override, capsys, empty_cache):
    assert main(["bench", "peak", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge bench: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert not (empty_cache / "peak_flops.json").exists()


def test_the_help_examples_use_only_real_recipe_keys():
    keys = {f.name for f in dataclasses.fields(BenchRecipe)}
    examples = [line for line in bench.__doc__.splitlines() if line.strip().startswith("lmforge bench peak")]
    used = {arg.split("=")[0] for line in examples for arg in line.split("#")[0].split()[3:]}
    assert "measure" in used and used <= keys
    assert "--" not in bench.__doc__  # options are key=value overrides, not flags


def test_a_stated_peak_wins_over_the_cache_and_the_data_sheet_and_nothing_is_timed(h100, monkeypatch):
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda *a, **k: pytest.fail("a stated peak is not timed"))
    store_peak(CPU, torch.float32, 100e9)
    monkeypatch.setenv(metrics.PEAK_ENV, "float32=3e11, bfloat16=1.2e12")
    assert peak_flops(CPU, torch.float32) == 3e11 and peak_flops(GPU, torch.bfloat16) == 1.2e12
    assert peak_flops(GPU, torch.float16) == 989e12  # a dtype it does not state falls through to the data sheet


@pytest.mark.parametrize("value", ["float32", "float32=fast", "float32=0", "float32=nan"])
def test_a_malformed_stated_peak_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(metrics.PEAK_ENV, value)
    with pytest.raises(ValueError, match=metrics.PEAK_ENV):
        peak_flops(CPU, torch.float32)


class SimulatedDevice:
    """A clock and a matmul of a device computing ``flops_per_s``: each product advances the clock."""

    def __init__(self, flops_per_s: float):
        self.now, self.rate, self.sizes = 0.0, flops_per_s, []

    def perf_counter(self) -> float:
        return self.now

    def product(self, a, b):
        self.now += 2 * a.shape[0] ** 3 / self.rate
        self.sizes.append(a.shape[0])


@pytest.mark.parametrize("flops_per_s", [1e9, 200e9, 1e13])  # emulated fp16 on AMD EPYC, fp32 there, a GPU
def test_measuring_a_peak_takes_about_the_time_asked_however_slow_the_dtype(monkeypatch, flops_per_s):
    """Timing 2048^3 products at emulated fp16's ~1 GFLOP/s took over a minute per process (and
    timed out the torchrun tests); the size now grows only while a product is cheap."""
    device = SimulatedDevice(flops_per_s)
    monkeypatch.setattr(metrics, "time", device)
    monkeypatch.setattr(metrics.torch, "mm", device.product)
    monkeypatch.setattr(metrics.F, "linear", device.product)
    monkeypatch.setattr(metrics.torch, "randn", lambda n, m, device, dtype: torch.empty(n, 0))
    best = metrics.measure_matmul_peak(CPU, torch.float16, n=2048, seconds=1.0)
    assert best == pytest.approx(flops_per_s)
    assert device.now <= 2.0  # the budget, and at most one size past the point where it stopped growing
    # at 1 GFLOP/s one 256^3 product already takes a thirtieth of the second: the size stays there
    assert max(device.sizes) == (256 if flops_per_s == 1e9 else 2048)
