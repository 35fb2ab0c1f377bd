"""The OLMo 2 family (``lmforge.model.families.olmo2``) against transformers' ``Olmo2ForCausalLM``:
its parity variants (tests/model/test_parity.py runs them through training, cached decoding, a
pipeline split and HF export), every config.json key classified and held to transformers' logits,
``lmforge import`` / ``lmforge export`` both ways, training, LoRA, checkpoints and its refusals."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import atomic_directory
from lmforge.model.families import build, model_config
from lmforge.model.families.olmo2 import Olmo2, Olmo2Config
from lmforge.model.families.olmo2.model import Olmo2Attention
from lmforge.model.fused import fused_copy, onednn_packs
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_to_hf
from lmforge.model.transformer import pair_rotations, rotation_tables
from lmforge.peft.lora import LoraConfig, apply_lora, merge_lora
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.model.families.hf_keys import CACHE_ONLY, HfKeys, from_folder, logits, randomize_
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

# test_parity.py's BASE (4 layers, width 64, 4 heads, vocabulary 256) with these fields
PARITY_VARIANTS = {
    "olmo2:mup": dict(family="olmo2", mup={"base_width": 16, "base_head_dim": 4}, n_kv_heads=2),  # µP: the score factor in the QK-norm
    "olmo2:gqa": dict(family="olmo2", n_kv_heads=2, norm_eps=1e-6),
    "olmo2:mqa-head-dim-tied": dict(family="olmo2", n_kv_heads=1, head_dim=32, tie_embeddings=True),
    "olmo2:attention-bias": dict(family="olmo2", qkv_bias=True, out_bias=True, n_kv_heads=2),
    "olmo2:llama3-rope": dict(family="olmo2", rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                              rope_high_freq_factor=4.0, rope_original_max_seq_len=16, n_kv_heads=2),
    # head_dim 32: every YaRN key shapes the tables (test_parity's yarn-rope)
    "olmo2:yarn-rope": dict(family="olmo2", rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64,
                            rope_beta_fast=4.0, rope_beta_slow=0.5, rope_mscale=1.0, rope_mscale_all_dim=0.5,
                            rope_truncate=False, n_kv_heads=2, head_dim=32),
    "olmo2:yarn-attention-factor": dict(family="olmo2", rope_scaling="yarn", rope_factor=8.0, rope_original_max_seq_len=16,
                                        rope_attention_factor=1.2),
    # every forward past the original context of 2: the long factors, in training and each decoding step
    "olmo2:longrope": dict(family="olmo2", rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=2,
                           rope_short_factor=[1.0 + 0.5 * i for i in range(8)],
                           rope_long_factor=[1.0 + 2.0 * i for i in range(8)], n_kv_heads=2),
}

SMALL = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def small(**fields) -> Olmo2Config:
    return model_config({"family": "olmo2", **SMALL, **fields})


def random_model(cfg: Olmo2Config) -> Olmo2:
    """Norm gains and biases random too, so a mis-mapped one shows; the same values at every call."""
    return randomize_(build(cfg))


# --------------------------------------------------------------------------- the model


def test_the_family_builds_olmo2_blocks_with_post_norms_and_whole_projection_qk_norms():
    model = build(small())
    assert type(model) is Olmo2
    block = model.layers[0]
    assert not hasattr(block, "attn_norm") and not hasattr(block, "mlp_norm")  # no norm before a branch
    assert block.post_attn_norm.weight.shape == block.post_mlp_norm.weight.shape == (64,)
    assert isinstance(block.attn, Olmo2Attention) and block.attn.q_norm is None  # no per-head QK-norm
    assert block.attn.q_proj_norm.weight.shape == (4 * 16,) and block.attn.k_proj_norm.weight.shape == (2 * 16,)


@torch.no_grad()
def test_the_whole_projection_qk_norm_couples_the_heads():
    """Scaling one head's query moves every head's normalised query: the norm is over all heads at once."""
    attn = random_model(small()).layers[0].attn
    x = torch.randn(1, 5, 64)
    q, _, _ = attn.project_qkv(x)
    raw = attn.wq(x)
    expected = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + attn.q_proj_norm.eps) * attn.q_proj_norm.weight
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=0)
    per_head = raw.unflatten(-1, (4, 16))
    per_head = per_head * torch.rsqrt(per_head.pow(2).mean(-1, keepdim=True) + attn.q_proj_norm.eps)
    assert (q - per_head.flatten(-2) * attn.q_proj_norm.weight).abs().max() > 1e-2  # not Qwen3's per-head norm


@pytest.mark.parametrize("variant", ["olmo2:gqa", "olmo2:mqa-head-dim-tied", "olmo2:attention-bias"])
@torch.no_grad()
def test_the_decoding_layouts_attention_computes_the_plain_attention(variant):
    """q/k rows in pair order, joined and packed as ``fused_copy`` lays them out, the QK-norm gains read in that
    order: the output matches the plain attention to float32 summation order."""
    from tests.model.test_parity import BASE, tolerance

    cfg = model_config({**BASE, **PARITY_VARIANTS[variant]})
    model = randomize_(build(cfg))
    fused = fused_copy(model, pack=onednn_packs(torch.float32, torch.device("cpu")))
    x = torch.randn(2, 11, cfg.d_model)
    cos, sin = model.rope_cos[None, :11], model.rope_sin[None, :11]
    plain = model.layers[1].attn(x, rotation_tables(cos, sin))
    got = fused.layers[1].attn(x, pair_rotations(cos, sin))
    torch.testing.assert_close(got, plain, atol=tolerance(torch.float32, 1, float(plain.abs().max())), rtol=0)


@pytest.mark.parametrize("fields, named", [
    (dict(norm="layernorm"), "norm = 'layernorm' is not supported by family 'olmo2': OLMo 2's norms are RMSNorm"),
    (dict(ffn="gelu"), "ffn = 'gelu' is not supported by family 'olmo2'"),
    (dict(positions="alibi"), "positions = 'alibi' is not supported by family 'olmo2'"),
    (dict(qk_norm=True), "qk_norm = True is not supported by family 'olmo2': OLMo 2 always normalises the whole q and k"),
    (dict(mlp_bias=True), "mlp_bias = True is not supported by family 'olmo2'"),
    (dict(sliding_window=8), "sliding_window = 8 is not supported by family 'olmo2': Olmo2ForCausalLM attends"),
    (dict(qkv_bias=True), "qkv_bias = True with out_bias = False is not supported by family 'olmo2'"),
])
def test_a_field_olmo2_does_not_compute_is_refused_in_one_line(fields, named):
    with pytest.raises(ValueError) as info:
        small(**fields)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_recipe_of_a_field_olmo2_does_not_compute_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="qk_norm = True is not supported by family 'olmo2'"):
        load_config(PretrainRecipe, None, ["model.preset=olmo2-tiny", "model.qk_norm=true", f"run_dir={tmp_path}"])


def test_tensor_parallelism_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^tensor parallelism does not support model family 'olmo2': its QK-norm "
                                          r"normalises the whole q and k projections.*set parallel.tp = 1"):
        build(small()).tp_plan(None)


def test_presets_have_the_shapes_of_the_released_models():
    one_b, seven_b = (Olmo2Config.from_preset(name) for name in ("olmo2-1b", "olmo2-7b"))
    assert (one_b.d_model, one_b.n_layers, one_b.n_heads, one_b.ffn_hidden, one_b.vocab_size) == (2048, 16, 16, 8192, 100352)
    assert (seven_b.d_model, seven_b.n_layers, seven_b.n_heads, seven_b.ffn_hidden) == (4096, 32, 32, 11008)
    # OLMo 2 7B: 7.30B parameters (its model card's 7B); 1B: 1.48B
    assert round(seven_b.num_params() / 1e9, 2) == 7.30 and round(one_b.num_params() / 1e9, 2) == 1.48


# --------------------------------------------------------------------------- config.json keys

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, eos_token_id=None)
# key -> (what else the pair of configs sets, the value away from the default)
VARIANTS: dict[str, tuple[dict, object]] = {
    "vocab_size": ({}, 301),
    "hidden_size": ({}, 96),
    "intermediate_size": ({}, 96),
    "num_hidden_layers": ({}, 3),
    "num_attention_heads": ({}, 8),
    "num_key_value_heads": ({}, 1),
    "head_dim": ({}, 32),
    "rms_norm_eps": ({}, 0.5),
    "tie_word_embeddings": ({}, True),
    "max_position_embeddings": ({}, 128),
    "hidden_act": ({}, "gelu"),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    # transformers < 5's spelling; dynamic NTK past the 16 positions, in the 32-token input
    "rope_scaling": ({"max_position_embeddings": 16}, {"rope_type": "dynamic", "factor": 4.0}),
    "rope_theta": ({}, 300.0),
    "original_max_position_embeddings": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, 16),
    "attention_bias": ({}, True),
    "attention_dropout": ({}, 0.1),
    "partial_rotary_factor": ({}, 0.5),
    "sliding_window": ({}, 8),
    "layer_types": ({"sliding_window": 8}, ["sliding_attention", "full_attention"]),
    "quantization_config": ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    "pruned_heads": ({}, {"0": [1]}),
    "auto_map": ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
}
NOT_ON_EVAL_LOGITS = {  # keys whose change a tiny model cannot show on its eval logits, and why
    "sliding_window": CACHE_ONLY,
    "layer_types": CACHE_ONLY,
    "max_position_embeddings": "the context bound: no effect on a shorter input with plain RoPE; the import must keep it",
    "attention_dropout": "acts in training only: the test checks transformers' train-mode logits move",
    "partial_rotary_factor": "Olmo2's plain RoPE drops it; weights of a folder that sets it expect part of each head "
                             "unrotated, so lmforge refuses rather than guess",
    "quantization_config": "building a quantized model needs a quantization backend; the weights are not plain matrices",
    "pruned_heads": "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    "auto_map": "custom modelling code (trust_remote_code) computes the model; the test builds none",
}
# tests/model/families/test_hf_config_keys.py holds every key against transformers by this
HF_KEYS = HfKeys(family="olmo2", classes={"olmo2": transformers.Olmo2Config}, base={"olmo2": BASE}, variants=VARIANTS,
                 not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=Olmo2)


def build_folder(path: Path, fields: dict, patch: dict) -> torch.nn.Module:
    return HF_KEYS.build_folder(path, "olmo2", fields, patch)


def test_a_released_olmo2_config_json_imports_as_its_preset():
    """allenai/OLMo-2-1124-7B's config.json, key for key, is the olmo2-7b preset."""
    config = {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
              "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 100352}
    assert model_config_from_hf(config) == dataclasses.replace(Olmo2Config.from_preset("olmo2-7b"), preset=None)


# --------------------------------------------------------------------------- lmforge import / export


@pytest.mark.parametrize("fields", [
    dict(),
    dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1),
    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}),
], ids=["plain", "biases-tied-mqa", "yarn"])
def test_cli_import_then_export_round_trips_transformers_model_and_logits(tmp_path, capsys, fields):
    theirs = build_folder(tmp_path / "hf", fields, {})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    expected = logits(theirs)
    assert (logits(ours) - expected).abs().max().item() <= 1e-5

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Olmo2ForCausalLM"]
    again = from_folder(tmp_path / "out")
    assert (logits(again) - expected).abs().max().item() <= 1e-5
    original, written = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)


# --------------------------------------------------------------------------- training, LoRA, checkpoints


def test_pretraining_an_olmo2_lowers_the_loss(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    recipe = load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        tmp_path / "run", shards_dir, small_tokenizer_dir, **{"model.family": "olmo2", "train.lr": 1e-2}))
    run_pretrain(recipe)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    model, _ = load_model(tmp_path / "run")
    assert type(model) is Olmo2 and model.cfg.family == "olmo2"


@torch.no_grad()
def test_lora_applies_to_every_projection_and_merges_into_the_same_logits():
    cfg = small()
    model = random_model(cfg)
    wrapped = apply_lora(model, LoraConfig(r=4, alpha=8))
    assert len(wrapped) == 7 * cfg.n_layers  # q, k, v, o, w1, w2, w3 of each block
    for name, p in model.named_parameters():
        assert p.requires_grad == name.endswith(("lora_A.weight", "lora_B.weight"))
        if name.endswith("lora_B.weight"):
            p.normal_(0.0, 0.05)  # a trained adapter: B away from zero
    adapted = logits(model)
    assert (adapted - logits(random_model(cfg))).abs().max() > 1e-3
    merge_lora(model)
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)),
                                                           attn_implementation="eager").eval()
    theirs.load_state_dict(state_dict_to_hf(model.state_dict(), cfg))
    torch.testing.assert_close(logits(theirs), adapted, atol=1e-5, rtol=0)


def test_a_checkpoint_round_trips_the_family_config_and_weights(tmp_path):
    cfg = small(qkv_bias=True, out_bias=True, tie_embeddings=True)
    model = random_model(cfg)
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    assert json.loads((tmp_path / "ckpt" / "model.json").read_text())["family"] == "olmo2"
    loaded, _ = load_model(tmp_path / "ckpt")
    assert type(loaded) is Olmo2 and loaded.cfg == cfg
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(loaded), logits(model))
