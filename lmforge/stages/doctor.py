"""`lmforge doctor`: what a bug report needs, in one command. Versions of lmforge and the
libraries it runs on, the CPU (model, the flags that decide its fast dtypes, cores, memory),
the matmul peaks measured on this machine (`lmforge bench peak`; none are measured here), the
GPUs, whether the chat page's browser test can find Chromium, and the free disk where runs go.

  lmforge doctor                   # lines to paste into an issue
  lmforge doctor json=true         # the same as JSON
  lmforge doctor run_dir=/scratch  # free disk there instead of ./runs
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from lmforge.core.config import option
from lmforge.train.metrics import cached_peak, peak_cache_path

PACKAGES = ("lmforge", "torch", "transformers", "tokenizers", "safetensors", "numpy", "peft", "lm_eval",
            "fastapi", "uvicorn", "openai", "jinja2", "pyyaml")
# the flags that decide which dtypes are fast here (AMX: bf16 matmuls ~7x fp32; avx512_bf16
# without AMX: ~4x on AMD EPYC; neither: bf16 slower than fp32)
CPU_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx2", "fma")
PEAK_DTYPES = ("float32", "bfloat16", "float16")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@dataclass
class DoctorRecipe:
    run_dir: str = option("runs", help="free disk is reported for this folder (or the nearest parent that exists)")
    json: bool = option(False, help="print JSON instead of lines")


def package_versions() -> dict[str, str | None]:
    """Each package's installed version, None where it is not installed."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """Model name, the flags of ``CPU_FLAGS`` it has, logical cores and memory (Linux's /proc)."""
    if cpuinfo is None:
        cpuinfo = read_text("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    mem = next((line.split()[1] for line in read_text("/proc/meminfo").splitlines() if line.startswith("MemTotal:")), None)
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(int(mem) / 2**20, 1) if mem else None,
    }


def read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def gpu_info() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    return [{"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]


def free_disk(run_dir: str) -> dict[str, Any]:
    """Free bytes in the nearest folder of ``run_dir`` that exists."""
    folder = Path(run_dir).absolute()
    while not folder.exists():
        folder = folder.parent
    usage = shutil.disk_usage(folder)
    return {"path": str(folder), "free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1)}


def report(recipe: DoctorRecipe) -> dict[str, Any]:
    cpu = torch.device("cpu")
    peaks = {name: cached_peak(cpu, name) for name in PEAK_DTYPES}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "torch": {"cuda": torch.version.cuda, "mkldnn": torch.backends.mkldnn.is_available(),
                  "cuda_available": torch.cuda.is_available()},
        "cpu": cpu_info(),
        "cpu_peak_flops": {k: v for k, v in peaks.items() if v is not None},
        "peak_cache": str(peak_cache_path()),
        "gpus": gpu_info(),
        "chromium": next((p for p in map(shutil.which, BROWSERS) if p), None),
        "chromedriver": shutil.which("chromedriver"),
        "disk": free_disk(recipe.run_dir),
    }


def report_lines(r: dict[str, Any]) -> list[str]:
    packages = ", ".join(f"{k} {v}" for k, v in r["packages"].items() if v is not None)
    missing = [k for k, v in r["packages"].items() if v is None]
    cpu = r["cpu"]
    peaks = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in r["cpu_peak_flops"].items())
    gpus = "; ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in r["gpus"])
    disk = r["disk"]
    return [
        f"python: {r['python']} on {r['platform']}",
        f"packages: {packages}" + (f" (not installed: {', '.join(missing)})" if missing else ""),
        f"torch: CUDA {r['torch']['cuda'] or 'none'}, oneDNN {'yes' if r['torch']['mkldnn'] else 'no'}",
        f"cpu: {cpu['model']}; {cpu['usable_cores']} of {cpu['logical_cores']} cores usable, torch threads "
        f"{cpu['torch_threads']}; memory {cpu['memory_gib']} GiB",
        f"cpu flags: {' '.join(cpu['flags']) or 'none of ' + ' '.join(CPU_FLAGS)}",
        f"cpu peaks: {peaks or 'not measured (lmforge bench peak)'} [{r['peak_cache']}]",
        f"gpus: {gpus or 'none'}",
        f"chromium: {r['chromium'] or 'not found (the chat page browser test skips)'}; "
        f"chromedriver: {r['chromedriver'] or 'not found'}",
        f"disk: {disk['free_gib']} GiB free of {disk['total_gib']} GiB at {disk['path']}",
    ]


def run(recipe: DoctorRecipe) -> dict[str, Any]:
    r = report(recipe)
    sys.stdout.write(json.dumps(r, indent=2) + "\n" if recipe.json else "\n".join(report_lines(r)) + "\n")
    return r


RECIPE = DoctorRecipe
