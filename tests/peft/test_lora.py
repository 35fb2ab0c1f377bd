"""LoRA / rsLoRA / DoRA match PEFT in float64 (outputs, gradients, merge), start at the base
model, and round-trip through PEFT's adapter format onto our exported HF model."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.core.io import atomic_directory
from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import load_adapter, save_adapter
from lmforge.peft.lora import LoraConfig, LoraLinear, apply_lora, lora_modules, lora_state_dict, merge_lora
from lmforge.stages.export import ExportRecipe, run_export

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft")  # the reference these tests compare against (a dev dependency)
transformers = pytest.importorskip("transformers")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 12, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class FixedMask(nn.Module):
    """Dropout with a fixed mask (scaled by 1/(1−p)), so PEFT and ours drop the same entries."""

    def __init__(self, mask: torch.Tensor, p: float):
        super().__init__()
        self.register_buffer("mask", mask)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask / (1 - self.p)


def peft_and_ours(use_rslora: bool = False, use_dora: bool = False, dropout: float = 0.0) -> tuple[nn.Module, LoraLinear]:
    """PEFT's wrapped ``Tiny`` (random non-zero B, α ≠ r) and our ``LoraLinear`` with copied weights."""
    torch.manual_seed(0)
    base = Tiny().double()
    ours = LoraLinear(copy.deepcopy(base.lin), r=4, alpha=12, dropout=dropout, use_rslora=use_rslora, use_dora=use_dora)
    cfg = peft.LoraConfig(target_modules=["lin"], r=4, lora_alpha=12, lora_dropout=dropout, init_lora_weights=False, use_rslora=use_rslora, use_dora=use_dora)
    theirs = peft.get_peft_model(base, cfg)
    layer = theirs.base_model.model.lin
    with torch.no_grad():
        ours.lora_A.weight.copy_(layer.lora_A["default"].weight)
        ours.lora_B.weight.copy_(layer.lora_B["default"].weight)
        if use_dora:
            ours.lora_magnitude_vector.copy_(layer.lora_magnitude_vector["default"].weight)
    assert layer.lora_B["default"].weight.abs().sum() > 0
    return theirs, ours


def their_layer(theirs: nn.Module) -> nn.Module:
    return theirs.base_model.model.lin


def inputs() -> torch.Tensor:
    return torch.randn(5, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def assert_same_forward_and_grads(theirs: nn.Module, ours: LoraLinear, x: torch.Tensor) -> None:
    layer = their_layer(theirs)
    y_theirs, y_ours = theirs(x), ours(x)
    torch.testing.assert_close(y_ours, y_theirs)
    g = torch.randn_like(y_ours, generator=torch.Generator().manual_seed(2))
    (y_theirs * g).sum().backward()
    (y_ours * g).sum().backward()
    torch.testing.assert_close(ours.lora_A.weight.grad, layer.lora_A["default"].weight.grad)
    torch.testing.assert_close(ours.lora_B.weight.grad, layer.lora_B["default"].weight.grad)
    if ours.use_dora:
        torch.testing.assert_close(ours.lora_magnitude_vector.grad, layer.lora_magnitude_vector["default"].weight.grad)
    assert ours.base.weight.grad is None and ours.base.bias.grad is None


# --------------------------------------------------------------------------- vs PEFT


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("use_rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_forward_and_grads_match_peft(use_rslora, use_dora):
    theirs, ours = peft_and_ours(use_rslora=use_rslora, use_dora=use_dora)
    assert ours.scaling == pytest.approx(12 / (math.sqrt(4) if use_rslora else 4))
    assert their_layer(theirs).scaling["default"] == pytest.approx(ours.scaling)
    assert_same_forward_and_grads(theirs.train(), ours.train(), inputs())


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_dropout_placement_matches_peft_with_a_fixed_mask(use_dora):
    theirs, ours = peft_and_ours(use_dora=use_dora, dropout=0.25)
    x = inputs()
    mask = (torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) > 0.25).double()
    their_layer(theirs).lora_dropout["default"] = FixedMask(mask, 0.25)
    ours.lora_dropout = FixedMask(mask, 0.25)
    assert_same_forward_and_grads(theirs.train(), ours.train(), x)
    # in eval PEFT skips dropout (DoRA reuses the base output); so do we
    theirs.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merge_matches_peft_merge_and_unload_and_unmerge_restores_base(use_dora):
    theirs, ours = peft_and_ours(use_dora=use_dora)
    x = inputs()
    base_weight = ours.base.weight.detach().clone()
    with torch.no_grad():
        y = ours.eval()(x)
        ours.merge()
        assert ours.merged
        torch.testing.assert_close(ours(x), y)
        merged = theirs.merge_and_unload().lin
        torch.testing.assert_close(ours.base.weight, merged.weight)
        torch.testing.assert_close(ours.base.bias, merged.bias)
        ours.unmerge()
        assert not ours.merged
        torch.testing.assert_close(ours.base.weight, base_weight)
        torch.testing.assert_close(ours(x), y)


def test_dora_equals_lora_at_initialisation():
    torch.manual_seed(0)
    lin = nn.Linear(16, 12, bias=True).double()
    lora = LoraLinear(copy.deepcopy(lin), r=4, alpha=12)
    dora = LoraLinear(copy.deepcopy(lin), r=4, alpha=12, use_dora=True)
    dora.lora_A.load_state_dict(lora.lora_A.state_dict())
    torch.testing.assert_close(dora.lora_magnitude_vector.detach(), torch.linalg.norm(lin.weight, dim=1).detach())
    x = inputs()
    torch.testing.assert_close(dora(x), lora(x))
    torch.testing.assert_close(lora(x), lin(x))


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_init_follows_peft_conventions(init):
    torch.manual_seed(0)
    ours = LoraLinear(nn.Linear(256, 128), r=16, alpha=32, init=init)
    theirs = peft.get_peft_model(Tiny(), peft.LoraConfig(target_modules=["lin"], r=4, init_lora_weights=True if init == "kaiming" else "gaussian"))
    their = their_layer(theirs)
    assert ours.lora_A.weight.shape == (16, 256) and ours.lora_B.weight.shape == (128, 16)
    assert their.lora_A["default"].weight.shape == (4, 16) and not their.lora_B["default"].weight.any()
    assert not ours.lora_B.weight.any()
    a = ours.lora_A.weight.detach()
    if init == "kaiming":  # kaiming_uniform_(a=√5) is U(−1/√in, 1/√in)
        bound = 1 / math.sqrt(256)
        assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
        assert a.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    else:  # N(0, std = 1/r)
        assert a.std().item() == pytest.approx(1 / 16, rel=0.05)


# --------------------------------------------------------------------------- whole models


def tiny_cfg(vocab_size: int = 96, **fields) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32), **fields})


def randomize_adapters_(model: nn.Module, seed: int = 0) -> None:
    """Non-zero B (and perturbed magnitudes) so the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=g))
            if module.lora_magnitude_vector is not None:
                module.lora_magnitude_vector.mul_(1 + 0.1 * torch.randn(module.lora_magnitude_vector.shape, generator=g))


def test_apply_lora_freezes_the_base_and_starts_at_the_base_model():
    torch.manual_seed(0)
    model = Transformer(tiny_cfg()).eval()
    x = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        expected = model(x)
    names = apply_lora(model, LoraConfig(r=4, alpha=8, use_dora=True))
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3", "mlp.w2")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == set(lora_state_dict(model))
    assert all(n.endswith(("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")) for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


def test_apply_lora_selects_by_suffix_and_glob_and_explains_no_match():
    model = Transformer(tiny_cfg())
    assert apply_lora(copy.deepcopy(model), LoraConfig(target_modules=["wq", "lm_head"])) == ["layers.0.attn.wq", "layers.1.attn.wq", "lm_head"]
    assert apply_lora(copy.deepcopy(model), LoraConfig(target_modules=["layers.1.mlp.*"])) == ["layers.1.mlp.w1", "layers.1.mlp.w3", "layers.1.mlp.w2"]
    assert apply_lora(copy.deepcopy(model), LoraConfig(target_modules=r"layers\.0\.attn\.w[qv]")) == ["layers.0.attn.wq", "layers.0.attn.wv"]
    with pytest.raises(ValueError, match=r"q_proj.*layers\.\*\.attn\.wq"):
        apply_lora(copy.deepcopy(model), LoraConfig(target_modules=["q_proj"]))
    tied = Transformer(tiny_cfg(tie_embeddings=True))
    with pytest.raises(ValueError, match="tied"):
        apply_lora(tied, LoraConfig(target_modules=["lm_head"]))


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merged_model_equals_unmerged_in_eval(use_dora):
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(qkv_bias=True, out_bias=True)).double()
    apply_lora(model, LoraConfig(r=4, alpha=12, dropout=0.1, use_dora=use_dora, target_modules=["attn.wq", "attn.wo", "mlp.w2", "lm_head"]))
    randomize_adapters_(model)
    model.eval()
    x = torch.randint(0, 96, (3, 9))
    with torch.no_grad():
        expected = model(x)
        merged_names = merge_lora(model)
        assert merged_names and not lora_modules(model)
        assert all(type(model.get_submodule(n)) is nn.Linear for n in merged_names)
        torch.testing.assert_close(model(x), expected)


# --------------------------------------------------------------------------- PEFT adapter format


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus_texts) -> Path:
    path = tmp_path_factory.mktemp("tok300")
    train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=300)).save(path)
    return path


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_saved_adapter_loads_in_peft_with_identical_logits(tmp_path, tokenizer_dir, use_dora):
    torch.manual_seed(0)
    cfg = tiny_cfg(Tokenizer.load(tokenizer_dir).vocab_size)
    model = Transformer(cfg).eval()
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, tokenizer_dir)
        write_checksums(tmp)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))

    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = model(x)
    lora_cfg = LoraConfig(r=4, alpha=12, use_rslora=True, use_dora=use_dora)
    apply_lora(model, lora_cfg)
    randomize_adapters_(model)
    save_adapter(model, lora_cfg, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["use_dora"], config["use_rslora"]) == (4, 12, use_dora, True)

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours_logits = model(x)
    assert (ours_logits - base_logits).abs().max() > 1e-3  # the adapters matter
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours_logits, atol=1e-5, rtol=0)

    # and back: load_adapter onto a fresh copy of our base model reproduces the adapted model
    fresh = load_model(tmp_path / "ckpt")[0].eval()
    names = load_adapter(fresh, tmp_path / "adapter")
    assert names == sorted(lora_modules(model))
    torch.testing.assert_close(lora_state_dict(fresh), lora_state_dict(model))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), ours_logits)


def test_adapter_config_names_single_layers_when_short_names_would_select_more(tmp_path):
    model = Transformer(tiny_cfg())
    cfg = LoraConfig(r=2, alpha=4, target_modules=["layers.0.attn.wq", "mlp.w2"])
    apply_lora(model, cfg)
    save_adapter(model, cfg, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    assert (config["peft_type"], config["task_type"], config["bias"], config["fan_in_fan_out"]) == ("LORA", "CAUSAL_LM", "none", False)
