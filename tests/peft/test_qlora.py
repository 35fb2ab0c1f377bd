"""QLoRA = a frozen NF4 base (``QuantizedLinear`` in ``NF4Format``) under a LoRA/DoRA adapter (``LoraConfig(quantize_base=True)``).

Checked on a tiny lmforge ``Transformer``: only adapters train, the 4-bit base never changes,
the model starts at the dequantised base, trains under bf16 autocast, and merges by
dequantise-then-merge into plain linears; one layer equals torchtune's QLoRA formula.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import load_adapter, save_adapter
from lmforge.peft.lora import LoraConfig, LoraLinear, apply_lora, lora_modules, lora_state_dict, merge_lora
from lmforge.peft.quant import NF4Format, QuantizedLinear, quantize_base_linears
from tests.conftest import import_reference

FORMATS = [True, "int4", "int3", "int2"]  # True is nf4, as before formats had names
# the logits' relative distance from fp32 at init: NF4 ~5%, HQQ int4 ~5%, int3 ~10%, int2 ~25% (test_loftq prints them)
INIT_ERROR = {True: 0.1, "int4": 0.1, "int3": 0.2, "int2": 0.4}
ATTN_AND_MLP = ["layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv", "layers.0.attn.wo",
                "layers.0.mlp.w1", "layers.0.mlp.w3", "layers.0.mlp.w2"]  # fmt: skip


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=32))


def qlora_cfg(**kw) -> LoraConfig:
    # d_model 64: a 64x64 weight has 64 blocks of 64, so scaler blocks of 64 (256 would not divide).
    # int formats: groups of 32 weights of a row (64 and 128 wide rows)
    kw = {"r": 4, "alpha": 12.0, "quantize_base": True, "nf4_block_size": 64, "nf4_scaler_block_size": 64,
          "group_size": 32} | kw
    return LoraConfig(**kw)


def tokens(batch: int = 4, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def randomize_adapters_(model: nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for module in lora_modules(model).values():
        module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=g) * 0.1)
        if module.lora_magnitude_vector is not None:
            module.lora_magnitude_vector.mul_(1 + 0.1 * torch.randn(module.lora_magnitude_vector.shape, generator=g))


def dequantised_copy(model: Transformer, qlora: nn.Module) -> Transformer:
    """``model`` with each QLoRA-targeted linear's weight replaced by its dequantised NF4 weight."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in lora_modules(qlora).items():
            reference.get_submodule(name).weight.copy_(module.base.dequantized_weight())
    return reference


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def test_quantize_base_puts_targeted_linears_in_nf4_and_leaves_the_rest():
    model = tiny_model()
    names = apply_lora(model, qlora_cfg())
    assert names == ATTN_AND_MLP + [n.replace("layers.0", "layers.1") for n in ATTN_AND_MLP]
    assert all(type(m) is LoraLinear and type(m.base) is QuantizedLinear for m in lora_modules(model).values())
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding

    with_head = tiny_model()
    apply_lora(with_head, qlora_cfg(target_modules=["wq", "lm_head"]))
    assert type(with_head.lm_head.base) is QuantizedLinear and type(with_head.layers[0].attn.wk) is nn.Linear


@pytest.mark.parametrize("fmt", FORMATS)
def test_only_adapters_train_and_the_quantised_base_is_unchanged_by_a_step(fmt):
    model = tiny_model()
    apply_lora(model, qlora_cfg(use_dora=True, quantize_base=fmt))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    frozen = {n: t.clone() for n, t in model.state_dict().items() if n not in trainable}
    assert any(n.endswith(".base.packed") for n in frozen)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lm_loss(model, tokens()).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B.weight"))  # A's is 0 while B = 0
    opt.step()

    after = model.state_dict()
    for name, before in frozen.items():
        assert torch.equal(after[name], before), name
    assert after["layers.0.attn.wq.base.packed"].dtype == (torch.int32 if fmt == "int3" else torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_at_init_output_equals_the_dequantised_model_and_is_close_to_fp32(use_dora, fmt):
    model = tiny_model().eval()
    qlora = copy.deepcopy(model)
    apply_lora(qlora, qlora_cfg(use_dora=use_dora, quantize_base=fmt))
    reference = dequantised_copy(model, qlora)
    x = tokens()
    with torch.no_grad():
        out, dequantised, full = qlora(x), reference(x), model(x)
    torch.testing.assert_close(out, dequantised, rtol=0, atol=0)
    # NF4 rounds each weight by up to ~10% of its block's absmax; the logits move by ~5% (norm).
    assert (out - full).norm() < INIT_ERROR[fmt] * full.norm()


def test_a_bf16_autocast_step_runs_and_the_loss_falls_on_a_fixed_batch():
    model = tiny_model()
    apply_lora(model, qlora_cfg(r=8, alpha=16.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = tokens()
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            assert logits.dtype == torch.bfloat16
            loss = F.cross_entropy(logits.float().reshape(-1, 128), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merge_lora_dequantises_then_merges_into_plain_linears(use_dora, fmt):
    model = tiny_model()
    apply_lora(model, qlora_cfg(use_dora=use_dora, quantize_base=fmt,
                                target_modules=["attn.wq", "attn.wo", "mlp.w2", "lm_head"]))
    randomize_adapters_(model)
    model.eval()
    expected_weight = {}
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            w = module.base.dequantized_weight() + module.scaling * module.lora_B.weight @ module.lora_A.weight
            if use_dora:
                w = (module.lora_magnitude_vector / torch.linalg.norm(w, dim=1)).view(-1, 1) * w
            expected_weight[name] = w
        x = tokens()
        expected = model(x)
        merged = merge_lora(model)
        assert sorted(merged) == sorted(expected_weight) and not lora_modules(model)
        for name in merged:
            linear = model.get_submodule(name)
            assert type(linear) is nn.Linear and linear.weight.dtype == torch.float32 and not linear.weight.requires_grad
            torch.testing.assert_close(linear.weight, expected_weight[name])
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)


def test_merge_in_place_on_an_nf4_base_refuses():
    layer = LoraLinear(QuantizedLinear.from_linear(nn.Linear(64, 32), NF4Format(32, 2)), r=4, alpha=8)
    with pytest.raises(RuntimeError, match="re-quantise.*merge_lora"):
        layer.merge()
    assert not layer.merged


def test_frozen_nf4_linears_take_about_half_a_byte_per_parameter():
    model = tiny_model()
    apply_lora(model, qlora_cfg())
    bases = [m.base for m in lora_modules(model).values()]
    params = sum(b.in_features * b.out_features for b in bases)
    per_param = sum(b.nbytes() for b in bases) / params
    # 0.5 (codes) + 1/64 (int8 scale per block) + 4/(64·64) (fp32 factor per scaler block), + a 4-byte mean per layer
    assert per_param == pytest.approx(0.5 + 1 / 64 + 4 / 64**2 + 4 * len(bases) / params)
    assert per_param < 4 / 7  # vs 4 bytes per fp32 parameter


def test_a_group_size_that_does_not_divide_a_targets_width_names_the_key_and_leaves_the_model():
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq' to int2: group_size=48 does not divide .* 64.*lora\.group_size"):
        apply_lora(model, qlora_cfg(quantize_base="int2", group_size=48))
    assert not lora_modules(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_target_that_does_not_fit_the_blocks_is_named_and_the_model_is_left_unchanged():
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    # 64x64 weights have 64 blocks of 64: not a multiple of the default 256-scale blocks.
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq'.*scaler_block_size=256"):
        apply_lora(model, LoraConfig(quantize_base=True))
    assert not lora_modules(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_qlora_layer_equals_torchtunes_formula(bias):
    torch.manual_seed(0)
    base = nn.Linear(64, 48, bias=bias)
    layer = LoraLinear(QuantizedLinear.from_linear(base, NF4Format(32, 2)), r=4, alpha=12)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 5, 64)
    # torchtune LoRALinear(quantize_base=True): linear_nf4(x, W) (+ b) + s·B(A(dropout(x)))
    w = layer.base.dequantized_weight()
    expected = F.linear(x, w) + (base.bias if bias else 0) + 3.0 * F.linear(F.linear(x, layer.lora_A.weight), layer.lora_B.weight)
    torch.testing.assert_close(layer(x), expected)

    to_nf4 = import_reference("torchao.quantization").to_nf4
    torch.testing.assert_close(w, to_nf4(base.weight.detach(), 32, 2).get_original_weight(), rtol=0, atol=0)


def test_adapters_on_a_bf16_nf4_base_are_bf16_and_run_in_bf16():
    layer = LoraLinear(QuantizedLinear.from_linear(nn.Linear(64, 32).to(torch.bfloat16), NF4Format(32, 2)), r=4, alpha=8)
    assert layer.lora_A.weight.dtype == torch.bfloat16
    assert layer(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_qlora_adapter_round_trips_through_the_peft_folder(tmp_path, fmt):
    model = tiny_model()
    apply_lora(model, qlora_cfg(use_dora=True, quantize_base=fmt))
    randomize_adapters_(model)
    save_adapter(model, qlora_cfg(use_dora=True, quantize_base=fmt), tmp_path / "adapter")

    fresh = tiny_model()
    apply_lora(fresh, qlora_cfg(use_dora=True, quantize_base=fmt))
    load_adapter(fresh, tmp_path / "adapter")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model.eval()(x), rtol=0, atol=0)


def test_apply_lora_wraps_linears_already_quantised_by_quantize_base_linears():
    model = tiny_model()
    quantize_base_linears(model, NF4Format(64, 64), lambda name, _: name != "lm_head")
    names = apply_lora(model, LoraConfig(r=4, target_modules=["wq", "wv"]))
    assert len(names) == 4 and all(type(lora_modules(model)[n].base) is QuantizedLinear for n in names)
    assert type(model.layers[0].attn.wk) is QuantizedLinear
