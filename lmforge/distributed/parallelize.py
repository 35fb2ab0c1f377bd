"""Transformations applied to a built model, in torchtitan's order: TP, activation checkpointing, compile, FSDP.

The model code knows nothing about them; each function takes a model whose blocks are
``model.layers`` (a ModuleList, or a ModuleDict for a pipeline stage) and changes it in
place. Parameter names, and so checkpoints, are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.core.config import ConfigError


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool) -> None:
    """Megatron-style tensor parallelism with DTensor (Shoeybi et al. 2019; Korthikanti et al. 2022).

    The model's family declares each block's plan (``Transformer.tp_plan``): attention split by
    heads (Q, K, V column-wise, output projection row-wise) and the MLP by width (w1, w3
    column-wise, w2 row-wise), so each block needs one all-reduce
    forward and one backward. The embedding is split by vocabulary (row-wise) and so is
    the output head (column-wise); with ``loss_parallel`` its logits stay sharded and
    the cross-entropy runs inside ``torch.distributed.tensor.parallel.loss_parallel``.
    With ``sequence_parallel`` the norms and the residual stream are split along the
    sequence, turning each all-reduce into a reduce-scatter + all-gather.
    """
    tp = tp_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    root = {}
    if getattr(model, "embed", None) is not None:
        root["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "lm_head", None) is not None:
        if sequence_parallel:
            root["norm"] = SequenceParallel()
        root["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    tied = getattr(model, "embed", None) is not None and getattr(model, "lm_head", None) is not None \
        and model.lm_head.weight is model.embed.weight
    parallelize_module(model, tp_mesh, root)
    if tied:  # both styles split the shared matrix by vocabulary: keep one parameter
        model.lm_head.weight = model.embed.weight
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(output_layouts=seq),
        # attn(x, rope, attn_mask, kv_cache) and mlp(x): under sequence parallelism gather the sequence of x only
        "attention": lambda: PrepareModuleInput(input_layouts=(seq, None, None, None),
                                                desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
        "mlp": lambda: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True),
        "norm": lambda: SequenceParallel(),
        "output_norm": lambda: SequenceParallel(use_local_output=True),  # added to the local residual shard
    }
    for block in model.layers.children():
        plan = {name: styles[role]() for name, role in model.tp_plan(block).items()
                if sequence_parallel or role in ("colwise", "rowwise")}
        parallelize_module(block, tp_mesh, plan)
        block.attn.n_heads //= tp  # the local projections hold this device's heads
        block.attn.n_kv_heads //= tp
    if sequence_parallel and getattr(model, "pos_embed", None) is not None:
        # learned positions (B or 1, T, d) are added to the embedding's sequence shard: each rank keeps its
        # positions' rows (the split's backward gathers the gradient, so the replicated table's is whole)
        distribute_module(model.pos_embed, tp_mesh, input_fn=_inputs_as_dtensors(Replicate()),
                          output_fn=lambda module, out, mesh: out.redistribute(mesh, [Shard(1)]).to_local())
    _distribute_remaining(model, tp_mesh)


def _distribute_remaining(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the parameters no plan split (norm gains) replicated DTensors, so that every
    parameter is a DTensor (one fused optimizer, one clipping rule). A norm sees the same
    activations on every tensor-parallel rank, except QK-norm, which sees this rank's heads
    (dim 1): there the gain's gradient is a partial sum that DTensor adds up over ranks."""
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for p in own):
            continue
        placement = Shard(1) if name.endswith(("q_norm", "k_norm")) else Replicate()
        distribute_module(module, tp_mesh, input_fn=_inputs_as_dtensors(placement), output_fn=_output_as_local)


def _inputs_as_dtensors(placement):
    def to_dtensor(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [placement], run_check=False) if isinstance(x, torch.Tensor) else x
                     for x in inputs)
    return to_dtensor


def _output_as_local(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(
            name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False))


def remove_activation_checkpointing(model: nn.Module) -> None:
    """Undo ``apply_activation_checkpointing``: each block again in place of its wrapper, so that
    module and parameter names are the model's own (what a saved adapter or export names)."""
    for name, block in list(model.layers.named_children()):
        if isinstance(block, CheckpointWrapper):
            model.layers.register_module(name, block._checkpoint_wrapped_module)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block separately: one graph reused by every layer, so compiling is quick."""
    for block in model.layers.children():
        block.compile(dynamic=False)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """FSDP2 (per-parameter sharding with DTensor) per block and at the root.

    ``reshard_after_forward=True`` frees each block's gathered weights after its forward and
    gathers them again for backward (ZeRO-3); ``False`` keeps them until backward (ZeRO-2-like:
    less communication, weights unsharded during the step). Weights are gathered in
    ``param_dtype``, gradients reduced in fp32. A 2-D ``dp_mesh`` (replicate, shard) is HSDP.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.children():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # the root group (embedding, final norm, head) is needed again first in backward: keep it
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def reshard(model: nn.Module) -> None:
    """Free the gathered weights FSDP2 keeps after a forward that no backward follows (the root's,
    and every block's under ``reshard_after_forward=False``), so the model holds its shards again:
    the parameters an optimizer built next must see, and the memory the sharding is for."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parallelize_model(model: nn.Module, ctx, *, precision: str, activation_checkpointing: bool, compile: bool) -> None:
    """Apply the layout of ``ctx`` (a ParallelContext) to ``model`` in torchtitan's order: TP, AC, compile, FSDP."""
    layout, cfg = ctx.layout, ctx.cfg
    if layout.tp > 1 and getattr(getattr(model, "cfg", None), "positions", "rope") == "alibi":
        raise ConfigError(f"parallel.tp = {layout.tp} with model.positions = alibi: ALiBi's per-head bias is not split "
                          "across tensor-parallel ranks; train an ALiBi model with tp = 1 (FSDP, pipelines)")
    if layout.tp > 1:
        apply_tp(model, ctx.tp_mesh, loss_parallel=cfg.loss_parallel and layout.pp == 1,
                 sequence_parallel=cfg.sequence_parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if layout.dp > 1:
        mp = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if precision == "bf16" else "fp32")
        apply_fsdp(model, ctx.dp_mesh, param_dtype=torch.bfloat16 if mp == "bf16" else torch.float32,
                   reshard_after_forward=cfg.reshard_after_forward)
