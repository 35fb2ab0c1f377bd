"""Measure this machine. `lmforge bench peak` gives the matmul peak FLOP/s per dtype that
MFU is measured against. A CPU, or a GPU missing from the data-sheet table, is timed on
square matmuls and the best rate is cached. A GPU in the table uses its data-sheet figure
(printed here) unless `measure=true` is given: then it is timed too, and the measured
figure is cached and used instead. A cached figure is only ever raised: a rerun keeps the
higher of the new measurement and the cached one, since a peak is the best the hardware
reaches and other work running at the same time only lowers it. Run it on an idle
machine; delete the cache file (LMFORGE_CACHE/peak_flops.json) to start over. Without it,
the first stage on a machine that needs a peak measures it the same way and caches it.
A figure stated in the environment wins over both and nothing is timed:
LMFORGE_PEAK_FLOPS=float32=2e11,bfloat16=9e11 (the test suite sets it).

  lmforge bench peak                 # fp32 and bf16 on the default device
  lmforge bench peak dtypes=[float32,bfloat16,float16] seconds=5
  lmforge bench peak measure=true    # on a GPU: measure, and use that instead of the data sheet
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.core.config import load_config, option, positive
from lmforge.core.run import log
from lmforge.train.metrics import (
    STABLE_SECONDS,
    STABLE_SIZE,
    cached_peak,
    datasheet_peak,
    measure_matmul_peak,
    peak_cache_path,
    store_peak,
)

PEAK_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class BenchRecipe:
    what: Literal["peak"] = option("peak", help="peak: matmul FLOP/s per dtype, cached for MFU")
    device: str = option("auto", help="auto = cuda when available, else cpu")
    dtypes: list[str] = option(
        default_factory=lambda: ["float32", "bfloat16"], help="any of float32, bfloat16, float16"
    )
    size: int = positive(STABLE_SIZE, help="n of the n x n matmul")
    seconds: float = positive(STABLE_SECONDS, help="per dtype; the best rate observed is kept")
    measure: bool = option(False, help="a GPU in the data-sheet table: time it and use the measured figure for MFU")

    def __post_init__(self) -> None:
        allowed = ", ".join(PEAK_DTYPES)
        if not self.dtypes:
            raise ValueError(f"dtypes is empty: give one or more of {allowed}")
        unknown = [name for name in self.dtypes if name not in PEAK_DTYPES]
        if unknown:
            raise ValueError(f"dtypes: unknown dtype {unknown[0]!r}; choose from {allowed}")
        if self.size < 1 or self.seconds <= 0:
            raise ValueError(f"size and seconds must be positive, got size={self.size}, seconds={self.seconds}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["peak"], help="peak: matmul FLOP/s per dtype, cached for MFU")


def recipe_from_args(args: argparse.Namespace) -> BenchRecipe:
    return load_config(BenchRecipe, None, [f"what={args.what}", *args.overrides])


def run(recipe: BenchRecipe) -> dict[str, float]:
    """The peak FLOP/s per dtype that MFU will now be measured against on this device."""
    device = resolve_device(recipe.device)
    results = {}
    measured_any = False
    for name in recipe.dtypes:
        sheet = datasheet_peak(device, name)
        if sheet is not None and not recipe.measure:
            cached = cached_peak(device, name)
            results[name] = cached if cached is not None else sheet
            note = (f"(cached measurement; data sheet {sheet / 1e9:.1f})" if cached is not None
                    else "(data sheet; measure=true times this GPU)")
            print(f"{device.type} {name:<9} {results[name] / 1e9:10.1f} GFLOP/s {note}")
            continue
        value = measure_matmul_peak(device, getattr(torch, name), n=recipe.size, seconds=recipe.seconds)
        results[name] = store_peak(device, getattr(torch, name), value)
        measured_any = True
        note = f" (measured now {value / 1e9:.1f}; the higher cached figure is kept)" if results[name] > value else ""
        if sheet is not None:
            note += f" (data sheet {sheet / 1e9:.1f})"
        print(f"{device.type} {name:<9} {results[name] / 1e9:10.1f} GFLOP/s{note}")
    if measured_any:
        log.info("cached in %s", peak_cache_path())
    return results


RECIPE = BenchRecipe
