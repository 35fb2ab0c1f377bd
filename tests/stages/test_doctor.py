import json
import shutil

import torch

from lmforge.cli.main import main
from lmforge.stages.doctor import cpu_info, free_disk


def test_doctor_reports_this_machine_as_lines_and_as_json(tmp_path, capsys):
    assert main(["doctor", f"run_dir={tmp_path / 'not' / 'yet'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_key = {line.partition(":")[0]: line.partition(": ")[2] for line in lines}
    assert f"torch {torch.__version__}" in by_key["packages"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    assert (gpu in by_key["gpus"]) if gpu else by_key["gpus"] == "none"
    assert by_key["chromium"].startswith(shutil.which("chromium") or shutil.which("chromium-browser")
                                         or shutil.which("google-chrome") or "not found")
    assert by_key["disk"].endswith(f"at {tmp_path}")  # the nearest folder that exists
    assert main(["doctor", "json=true", f"run_dir={tmp_path}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["torch"] == torch.__version__ and report["packages"]["lmforge"] is not None
    assert report["cpu"]["torch_threads"] == torch.get_num_threads()
    assert 0 < report["disk"]["free_gib"] <= report["disk"]["total_gib"]
    assert report["disk"]["path"] == str(tmp_path)


def test_cpu_flags_are_read_from_cpuinfo():
    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16\nprocessor\t: 1\n")
    info = cpu_info(text)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["flags"] == ["amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_fp16", "avx2", "fma"]
    assert cpu_info("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t: avx2 avx512f avx512_bf16\n")["flags"] == [
        "avx512f", "avx512_bf16", "avx2"]


def test_free_disk_walks_up_to_the_folder_that_exists(tmp_path):
    usage = shutil.disk_usage(tmp_path)
    out = free_disk(str(tmp_path / "a" / "b"))
    assert out["path"] == str(tmp_path) and out["total_gib"] == round(usage.total / 2**30, 1)
