"""Plan a training run before launching it. `lmforge plan memory` prints the bytes each device
needs for parameters (fp32 master weights and the copies blocks compute with), gradients,
optimizer state (AdamW's, Muon's or LAMB's) and activations, under the recipe's parallel layout and precision, with and
without activation checkpointing, for the busiest pipeline stage. It reads a pretrain
recipe (model, data.seq_len, train.micro_batch_size, train.precision, parallel) plus
world_size (needed when parallel.dp_shard is -1). precision auto plans for bf16.

  lmforge plan memory recipes/distributed/llama3_405b.yaml
  lmforge plan memory recipes/demo/pretrain.yaml world_size=8 parallel.tp=2
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from lmforge.core.config import load_config, positive
from lmforge.core.run import format_count
from lmforge.distributed.memory import MemoryPlan, format_bytes, plan_memory
from lmforge.distributed.mesh import check_layout, resolve_layout
from lmforge.stages.pretrain import PretrainRecipe


@dataclass
class PlanRecipe(PretrainRecipe):
    world_size: int | None = positive(
        None, help="processes to plan for; None = the product of the degrees (dp_shard -1 as 1)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["memory"], help="what to plan (memory: bytes per device)")
    parser.add_argument("recipe", nargs="?", help="a pretrain recipe (YAML)")


def recipe_from_args(args: argparse.Namespace) -> PlanRecipe:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        recipe, overrides = None, [recipe, *overrides]
    return load_config(PlanRecipe, recipe, overrides)


OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon + AdamW", "lamb": "LAMB"}


def memory_plans(recipe: PlanRecipe) -> tuple[str, dict[bool, MemoryPlan]]:
    """The layout and the plans without and with activation checkpointing."""
    p = recipe.parallel
    world = recipe.world_size or p.dp_replicate * max(p.dp_shard, 1) * p.tp * p.pp
    layout = resolve_layout(p, world)
    check_layout(layout, p, recipe.model, recipe.train.micro_batch_size)
    precision = "bf16" if recipe.train.precision == "auto" else recipe.train.precision
    plans = {ac: plan_memory(recipe.model, p, layout, micro_batch_size=recipe.train.micro_batch_size,
                             seq_len=recipe.data.seq_len, precision=precision, activation_checkpointing=ac,
                             optimizer=recipe.train.optimizer)
             for ac in (False, True)}
    return f"{layout} ({layout.world_size} devices), {precision}", plans


def format_plan(recipe: PlanRecipe, layout: str, plans: dict) -> str:
    plain, ac = plans[False], plans[True]
    stage = f", pipeline stage {plain.stage} ({plain.detail['layers']} layers)" if recipe.parallel.pp > 1 else ""
    lines = [
        f"memory per device: {format_count(recipe.model.num_params())} parameters, layout {layout}, "
        f"micro-batch {recipe.train.micro_batch_size} x {recipe.data.seq_len} tokens{stage}",
        f"{'':28}{'no checkpointing':>18}{'activation ckpt':>18}",
    ]
    rows = [("parameters", "parameters"), ("  weights blocks compute with", "weights_compute"),
            ("gradients", "gradients"), (f"optimizer state ({OPTIMIZER_NAMES[recipe.train.optimizer]})", "optimizer"), ("activations", "activations"),
            ("total", "total")]
    for label, attr in rows:
        lines.append(f"{label:28}{format_bytes(getattr(plain, attr)):>18}{format_bytes(getattr(ac, attr)):>18}")
    lines.append(f"({format_count(plain.params_on_device)} parameters on this device before data-parallel sharding; "
                 "the total counts gradients beside activations, an upper bound)")
    return "\n".join(lines)


def run_plan(recipe: PlanRecipe) -> dict:
    layout, plans = memory_plans(recipe)
    print(format_plan(recipe, layout, plans))
    return {("with_ac" if ac else "without_ac"): dataclasses.asdict(plan) for ac, plan in plans.items()}


RECIPE = PlanRecipe
run = run_plan
