"""Runs inside ``torchrun``: the jobs of a JSON spec, one after another, on every rank.

A job is ``{"kind": "pretrain", "recipe": <yaml>}`` (``run_pretrain`` on the recipe; with
``"poison": [[start, stop], ...]`` the loader corrupts those global samples, as in
tests/train/test_spikes.py),
``{"kind": "sft" | "dpo" | "kto" | "reward" | "grpo" | "ppo", "recipe": <yaml>}`` (that fine-tuning stage on
its recipe) or
``{"kind": "gradients", "recipe": <yaml>, "out": <json>}``: one step's gradients of the
parallelized model against the same model unsharded (fp32) in this process, written by
rank 0 with the dtypes the blocks computed in and the gradients were kept in; or
``{"kind": "scaler", "out": <json>}``: two fp16 loss-scaler steps in which only rank 0's
gradient overflows (the first) or none does (the second), each rank's parameter and scale
after each, written by rank 0.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.core.config import load_config
from lmforge.data.loader import TokenLoader
from lmforge.distributed.mesh import init_parallel
from lmforge.distributed.parallelize import parallelize_model
from lmforge.distributed.pipeline import PipelineRunner, split_into_stage
from lmforge.distributed.scaler import DistributedGradScaler
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective, causal_lm_loss
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.stages.grpo import GRPORecipe, run_grpo
from lmforge.stages.kto import KTORecipe, run_kto
from lmforge.stages.ppo import PPORecipe, run_ppo
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.reward import RewardRecipe, run_reward
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.optim import build_adamw
from lmforge.train.step import build_step_runner
from tests.train.test_spikes import poisoned_next

STAGES = {"sft": (SFTRecipe, run_sft), "dpo": (DPORecipe, run_dpo), "kto": (KTORecipe, run_kto),
          "reward": (RewardRecipe, run_reward), "grpo": (GRPORecipe, run_grpo), "ppo": (PPORecipe, run_ppo)}


def gradients(recipe: PretrainRecipe, out: str) -> None:
    """Max |grad - reference grad| per parameter after one step of two micro-batches."""
    ctx = init_parallel(recipe.parallel, "cpu")
    layout, B, T = ctx.layout, recipe.train.micro_batch_size, recipe.data.seq_len
    torch.manual_seed(0)
    reference = Transformer(recipe.model)
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, recipe.model.vocab_size, (layout.dp * B, T + 1), generator=generator) for _ in range(2)]
    mine = [w[ctx.dp_rank * B:(ctx.dp_rank + 1) * B] for w in windows]
    if layout.pp > 1:
        model = split_into_stage(model, ctx.pp_rank, layout.pp)
    precision = recipe.train.precision
    parallelize_model(model, ctx, precision=precision, activation_checkpointing=recipe.train.activation_checkpointing,
                      compile=False)
    seen_dtypes = set()  # of the weights a block computes with (FSDP's gathered copies)
    first_block = next(iter(model.layers.children()))
    first_block.register_forward_pre_hook(lambda m, args: seen_dtypes.add(str(m.mlp_norm.weight.dtype)))
    pipeline = None
    if layout.pp > 1:
        pipeline = PipelineRunner(model, ctx, recipe.parallel.pp_microbatches or layout.pp,
                                  split=lambda b: (b[:, :-1], b[:, 1:]), loss_sum=causal_lm_loss)
    objective = CausalLMObjective()
    optimizer = build_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)  # not stepped: the gradients are compared
    loss = build_step_runner(model, objective, optimizer, precision, 1.0, parallel=ctx,
                             pipeline=pipeline).backward(mine)[0]

    n = sum(objective.num_targets(w) for w in windows)
    ref_loss = sum(objective(reference, w).loss_sum for w in windows) / n
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    diffs, grad_dtypes = {}, set()
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_dtypes.add(str(grad.dtype))
        # relative to the largest reference gradient of the tensor
        diffs[name] = ((grad - ref_grads[name].grad).abs().max() / ref_grads[name].grad.abs().max()).item()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (diffs, sorted(seen_dtypes), sorted(grad_dtypes)))
    if dist.get_rank() == 0:
        merged = {}
        for d, _, _ in gathered:
            for k, v in d.items():
                merged[k] = max(v, merged.get(k, 0.0))
        with open(out, "w") as f:
            json.dump({"loss": float(loss), "ref_loss": float(ref_loss), "grad_diff": merged, "n_params": len(ref_grads),
                       "compute_dtypes": sorted({t for _, s, _ in gathered for t in s}),
                       "grad_dtypes": sorted({t for _, _, g in gathered for t in g})}, f)
    dist.barrier()


def scaler_steps(out: str) -> None:
    """Each rank holds a different parameter, as pipeline stages do; only rank 0's gradient overflows."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.ones(3))
    # fused AdamW as the loop builds it: GradScaler hands it the verdict (its amp-scaling path); its first
    # step moves each weight by lr (m / sqrt(v) = g / |g|)
    optimizer = torch.optim.AdamW([param], lr=0.5, weight_decay=0.0, fused=True)
    scaler = DistributedGradScaler(torch.device("cpu"))
    seen = []
    for overflow in (True, False):
        (scaler.scale(param.sum()) * (float("inf") if overflow and rank == 0 else 1.0)).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append({"param": param.detach().tolist(), "scale": scaler.get_scale()})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        jobs = json.load(f)
    dist.init_process_group("gloo")
    try:
        for job in jobs:
            if job["kind"] in STAGES:
                recipe_type, run = STAGES[job["kind"]]
                run(load_config(recipe_type, job["recipe"]))
                continue
            if job["kind"] == "scaler":
                scaler_steps(job["out"])
                continue
            recipe = load_config(PretrainRecipe, job["recipe"])
            if job["kind"] == "pretrain":
                real = TokenLoader.__next__
                if job.get("poison"):
                    TokenLoader.__next__ = poisoned_next([tuple(r) for r in job["poison"]])
                try:
                    run_pretrain(recipe)
                finally:
                    TokenLoader.__next__ = real
            else:
                gradients(recipe, job["out"])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
