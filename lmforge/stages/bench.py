"""Measure this machine. `lmforge bench peak` times square matmuls in each dtype and caches
the best FLOP/s per dtype, which MFU is then measured against (GPU peaks come from a
table of data-sheet figures unless --measure is given). Run it on an idle machine: other
work running at the same time lowers the figure.

  lmforge bench peak                 # fp32 and bf16 on the default device
  lmforge bench peak dtypes=[float32,bfloat16,float16] seconds=5
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import torch

from lmforge.core.config import load_config
from lmforge.core.run import log
from lmforge.train.loop import resolve_device
from lmforge.train.metrics import datasheet_peak, measure_matmul_peak, store_peak


@dataclass
class BenchRecipe:
    what: Literal["peak"] = "peak"
    device: str = "auto"
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    size: int = 2048  # n of the n x n matmul
    seconds: float = 3.0  # per dtype; the best rate observed is kept


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["peak"], help="peak: matmul FLOP/s per dtype, cached for MFU")


def recipe_from_args(args: argparse.Namespace) -> BenchRecipe:
    return load_config(BenchRecipe, None, [f"what={args.what}", *args.overrides])


def run(recipe: BenchRecipe) -> dict:
    device = resolve_device(recipe.device)
    results = {}
    for name in recipe.dtypes:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
        value = measure_matmul_peak(device, dtype, n=recipe.size, seconds=recipe.seconds)
        path = store_peak(device, dtype, value)
        results[name] = value
        sheet = datasheet_peak(device, name)
        extra = f" (data sheet {sheet / 1e12:.0f} TFLOP/s)" if sheet else ""
        print(f"{device.type} {name:<9} {value / 1e9:10.1f} GFLOP/s{extra}")
    log.info("cached in %s", path)
    return results


RECIPE = BenchRecipe
