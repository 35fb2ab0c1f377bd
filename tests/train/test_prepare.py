"""``prepare_model``: the one order in which a model is made ready to train (adapters, head,
activation checkpointing, compile, parallelism), in one process here (tests/distributed run it
under torchrun)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lmforge.core.config import ConfigError
from lmforge.distributed.parallelize import remove_activation_checkpointing
from lmforge.model.config import ModelConfig
from lmforge.model.reward import RewardModel
from lmforge.peft.lora import LoraConfig, LoraLinear
from lmforge.train.loop import TrainConfig
from lmforge.train.prepare import prepare_model


def tiny() -> torch.nn.Module:
    from lmforge.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=16))


def test_adapters_then_head_then_activation_checkpointing_and_the_same_forward():
    model, tokens = tiny(), torch.randint(0, 64, (2, 8))
    expected = model(tokens)
    prepared = prepare_model(model, TrainConfig(activation_checkpointing=True), lora=LoraConfig(r=2), head=RewardModel)
    assert isinstance(prepared, RewardModel) and prepared.backbone is model
    assert all(isinstance(block, CheckpointWrapper) for block in model.layers)
    assert any(isinstance(m, LoraLinear) for m in model.modules())
    assert all(p.requires_grad == ("lora_" in n or not n.startswith("backbone.")) for n, p in prepared.named_parameters())
    assert torch.equal(model(tokens), expected)  # B = 0 at init and checkpointing recomputes, not changes
    remove_activation_checkpointing(prepared)
    assert not any(isinstance(m, CheckpointWrapper) for m in prepared.modules())
    assert "backbone.layers.0.attn.wq.base.weight" in dict(prepared.named_parameters())


def test_a_frozen_reference_copy_is_neither_checkpointed_nor_compiled():
    model = tiny()
    assert prepare_model(model, TrainConfig(activation_checkpointing=True, compile=True), frozen=True) is model
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in model.layers)


def test_compile_in_one_process_leaves_the_module_to_the_loops_one_graph():
    model = tiny()
    prepare_model(model, TrainConfig(compile=True))
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in model.layers)


def test_an_adapter_that_matches_nothing_is_a_config_error():
    with pytest.raises(ConfigError, match="lora:"):
        prepare_model(tiny(), TrainConfig(), lora=LoraConfig(r=2, target_modules=["nothing_here"]))
