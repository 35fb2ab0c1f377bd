"""The one way a built or loaded model is made ready to train, in every stage and process count:
adapters (LoRA/DoRA/QLoRA) -> a head around the transformer (a reward model's) -> activation
checkpointing -> compile -> TP/FSDP under torchrun, in torchtitan's order (``parallelize_model``).

Pre-training, SFT, reward-model training, DPO and KTO all call ``prepare_model``, so a training
option (``train.activation_checkpointing``, ``train.compile``) means the same in each of them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lmforge.core.config import ConfigError
from lmforge.core.run import format_count, log
from lmforge.distributed.mesh import ParallelContext
from lmforge.distributed.parallelize import apply_activation_checkpointing, parallelize_model
from lmforge.peft.lora import LoraConfig, apply_lora, check_quantizable
from lmforge.peft.quant import base_memory
from lmforge.train.loop import TrainConfig
from lmforge.train.muon import hidden_matrices
from lmforge.train.optim import width_mult


def prepare_model(model: nn.Module, cfg: TrainConfig, parallel: ParallelContext | None = None, *,
                  lora: LoraConfig | None = None, head: Callable[[nn.Module], nn.Module] | None = None,
                  frozen: bool = False, stage: str = "train") -> nn.Module:
    """``model`` ready for the loop (changed in place; returned, as ``head`` wraps it).

    ``lora`` adds adapters (the base frozen); ``head(model)`` builds the module trained around it
    (``RewardModel``: its head is new, so always trainable). Then ``cfg.activation_checkpointing``
    recomputes each block's activations in the backward pass. ``cfg.compile`` in one process is the
    loop's (forward and loss compiled as one graph, ``loop.compile_objective``), so the module is left
    as is; under ``parallel`` (a torchrun job) each block is compiled, then the model is laid out
    (TP, FSDP2/HSDP) by ``parallelize_model``. ``frozen`` prepares a copy that never runs backward (a
    live DPO/KTO reference): no checkpointing or compile, and FSDP frees every gathered weight after
    each forward. A model Muon cannot train (``train.optimizer: muon``, no trainable matrix in its
    blocks), or µP under an optimizer it has no rates for, is refused here, before the stage's work.
    """
    if lora is not None:
        wrap_lora(model, lora, stage)
    if head is not None:
        model = head(model)
    if not frozen:  # refuse now, before the stage scores or lays out the model
        width_mult(model, cfg.optimizer)  # µP with an optimizer it has no rates for
        if cfg.optimizer == "muon":
            hidden_matrices(model)
    checkpointing = cfg.activation_checkpointing and not frozen
    if parallel is None:
        if checkpointing:
            apply_activation_checkpointing(model)
        return model
    parallelize_model(model, parallel, precision=cfg.precision, activation_checkpointing=checkpointing,
                      compile=cfg.compile and not frozen)
    if frozen and parallel.layout.dp > 1:
        model.set_reshard_after_forward(True)
    return model


def check_lora_shapes(cfg: LoraConfig | None, shapes: Callable[[], dict[str, tuple[int, ...]]]) -> None:
    """Before a stage writes anything: every target of a quantised base fits the format's blocks or groups
    (``shapes()``: the checkpoint's parameter shapes by name, read only when ``cfg`` quantises)."""
    if cfg is None or not cfg.quantize_base:
        return
    try:
        check_quantizable(cfg, shapes())
    except ValueError as exc:
        raise ConfigError(f"lora: {exc}") from exc


def wrap_lora(model: nn.Module, cfg: LoraConfig, stage: str) -> None:
    """Apply LoRA/DoRA/QLoRA adapters in place; configuration problems become ``ConfigError``."""
    try:
        wrapped = apply_lora(model, cfg)
    except ValueError as exc:  # no matching target, a tied target, a shape the format cannot block or group
        raise ConfigError(f"lora: {exc}") from exc
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory = base_memory(model)
    quantized = "" if memory["format"] == "none" else (
        f", {memory['format']} ({memory['bits_per_adapted_weight']:.2f} bits per adapted weight, init {cfg.init})")
    log.info("%s: LoRA r=%d on %d linears: %s trainable parameters; frozen base %.1f MB%s", stage, cfg.r, len(wrapped),
             format_count(trainable), memory["base_bytes"] / 2**20, quantized)
