"""The Phi-3 family (``lmforge.model.families.phi3``) against transformers' ``Phi3ForCausalLM``: its parity
variants (tests/model/test_parity.py runs them through training, cached decoding, a pipeline split and HF
export), every config.json key classified and held to transformers' logits, the fused ``qkv_proj`` /
``gate_up_proj`` split on import and joined on export, ``lmforge import`` / ``lmforge export`` both ways,
LongRoPE on both sides of the original context, presets, training, LoRA, checkpoints and its refusals."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError, atomic_directory
from lmforge.model.families import build, model_config
from lmforge.model.families.phi3 import PHI35_MINI_LONG_FACTOR, PHI35_MINI_SHORT_FACTOR, Phi3, Phi3Config
from lmforge.model.families.phi3 import hf as phi3_hf
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_from_hf, state_dict_to_hf
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules, merge_lora
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.import_hf import ImportRecipe, run_import
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.model.families.hf_keys import TOKENS, HfKeys, from_folder, logits, randomize_
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

SHORT8 = [1.0 + 0.5 * i for i in range(8)]  # LongRoPE factors for a 16-wide head: one per RoPE pair
LONG8 = [1.0 + 2.0 * i for i in range(8)]

# test_parity.py's BASE (4 layers, width 64, 4 heads of 16, vocabulary 256, rows of up to 17 tokens) with these
PARITY_VARIANTS = {
    "phi3:mup": dict(family="phi3", mup={"base_width": 16, "base_head_dim": 4}, n_kv_heads=2),  # µP, exported through the joined qkv
    "phi3:mha": dict(family="phi3", norm_eps=1e-6),  # Phi-3-mini's attention: as many KV heads as heads
    "phi3:gqa": dict(family="phi3", n_kv_heads=2),  # Phi-3-small/medium's grouped KV heads
    "phi3:mqa-head-dim-tied": dict(family="phi3", n_kv_heads=1, head_dim=32, tie_embeddings=True),
    # Phi-3-mini-4k's window on every layer, shorter than the rows: the cache is a ring of 6 slots
    "phi3:sliding-window": dict(family="phi3", sliding_window=6, n_kv_heads=2),
    # every forward past the original context of 2: the long factors, in training and at each decoding step
    "phi3:longrope": dict(family="phi3", rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=2,
                          rope_short_factor=SHORT8, rope_long_factor=LONG8, n_kv_heads=2),
    # Phi-3.5-mini's parts: LongRoPE (an attention factor of its own) with a window on every layer
    "phi3:longrope-attention-factor-window": dict(family="phi3", rope_scaling="longrope", rope_factor=8.0,
                                                  rope_original_max_seq_len=2, rope_attention_factor=1.2,
                                                  rope_short_factor=SHORT8, rope_long_factor=LONG8, sliding_window=5),
}
# family -> its config's fields no variant changes, and why: those Phi3ForCausalLM computes at one value only
PARITY_NOT_ARITHMETIC = {"phi3": {
    name: f"fixed at {value!r} ({why}): test_a_field_phi3_does_not_compute_is_refused_in_one_line"
    for name, (value, why) in Phi3Config.FIXED_FIELDS.items()}}

SMALL = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def small(**fields) -> Phi3Config:
    return model_config({"family": "phi3", **SMALL, **fields})


def random_model(cfg: Phi3Config) -> Phi3:
    """Norm gains random too, so a mis-mapped one shows; the same values at every call."""
    return randomize_(build(cfg))


def the_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


# --------------------------------------------------------------------------- the model and its config


def test_the_family_builds_the_shared_pre_norm_blocks_without_biases():
    model = build(small())
    assert type(model) is Phi3 and model.cfg.family == "phi3"
    block = model.layers[0]
    assert block.attn_norm.weight.shape == block.mlp_norm.weight.shape == (64,)
    assert block.attn.q_norm is None and block.attn.wq.bias is None and block.attn.wo.bias is None
    assert block.mlp.w1.bias is None and block.mlp.w3.weight.shape == (128, 64)
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params()


def test_every_phi3_field_is_in_a_parity_variant_or_fixed():
    """test_parity.py's coverage check for this family: every field a variant changes, a field of its BASE, one
    it calls not arithmetic, or one Phi-3 fixes (``FIXED_FIELDS``, listed in ``PARITY_NOT_ARITHMETIC``)."""
    from tests.model.test_parity import BASE, NOT_ARITHMETIC

    default = model_config({**BASE, "family": "phi3"})
    for name, changes in PARITY_VARIANTS.items():
        assert any(getattr(model_config({**BASE, **changes}), k) != getattr(default, k) for k in changes), name
    covered = {"family"} | set(BASE) | {k for v in PARITY_VARIANTS.values() for k in v}
    covered |= NOT_ARITHMETIC.keys() | PARITY_NOT_ARITHMETIC["phi3"].keys()
    assert [f.name for f in fields(Phi3Config) if f.name not in covered] == []


@pytest.mark.parametrize("fields, named", [
    (dict(norm="layernorm"), "norm = 'layernorm' is not supported by family 'phi3': Phi-3's norms are RMSNorm"),
    (dict(ffn="gelu"), "ffn = 'gelu' is not supported by family 'phi3': Phi-3's MLP is SwiGLU"),
    (dict(positions="alibi"), "positions = 'alibi' is not supported by family 'phi3'"),
    (dict(qk_norm=True), "qk_norm = True is not supported by family 'phi3': Phi-3 has no QK-norm"),
    (dict(qkv_bias=True), "qkv_bias = True is not supported by family 'phi3': Phi-3's projections have no biases"),
    (dict(out_bias=True), "out_bias = True is not supported by family 'phi3'"),
    (dict(mlp_bias=True), "mlp_bias = True is not supported by family 'phi3'"),
    (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
     "layer_types = ['sliding_attention', 'full_attention'] is not supported by family 'phi3': Phi-3's "
     "sliding_window, when set, is on every layer"),
    (dict(rope_scaling="yarn", rope_original_max_seq_len=16),
     "rope_scaling = 'yarn' is not supported by family 'phi3': Phi3ForCausalLM computes plain RoPE or longrope"),
    (dict(rope_scaling="llama3", rope_original_max_seq_len=16), "rope_scaling = 'llama3' is not supported"),
    (dict(rope_scaling="linear", rope_factor=2.0), "rope_scaling = 'linear' is not supported"),
    (dict(rope_scaling="dynamic", rope_factor=2.0, rope_original_max_seq_len=16), "rope_scaling = 'dynamic' is not"),
])
def test_a_field_phi3_does_not_compute_is_refused_in_one_line(fields, named):
    with pytest.raises(ValueError) as info:
        small(**fields)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_recipe_of_a_field_phi3_does_not_compute_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="qk_norm = True is not supported by family 'phi3'") as info:
        load_config(PretrainRecipe, None, ["model.preset=phi3-tiny", "model.qk_norm=true", f"run_dir={tmp_path}"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="rope_scaling = 'yarn' is not supported by family 'phi3'"):
        load_config(PretrainRecipe, None, ["model.family=phi3", "model.rope_scaling=yarn",
                                           "model.rope_original_max_seq_len=512", f"run_dir={tmp_path}"])
    recipe = load_config(PretrainRecipe, None, ["model.preset=phi3-tiny", "model.sliding_window=256", f"run_dir={tmp_path}"])
    assert type(recipe.model) is Phi3Config and recipe.model.sliding_layers() == (True,) * 6


# the released models' config.json files, key for key (microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct)
_MICROSOFT = dict(architectures=["Phi3ForCausalLM"], attention_dropout=0.0, auto_map={
    "AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    bos_token_id=1, embd_pdrop=0.0, eos_token_id=32000, hidden_act="silu", hidden_size=3072, initializer_range=0.02,
    intermediate_size=8192, model_type="phi3", num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
    original_max_position_embeddings=4096, pad_token_id=32000, resid_pdrop=0.0, rms_norm_eps=1e-05, rope_theta=10000.0,
    tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, attention_bias=False, vocab_size=32064)
RELEASED = {
    "phi3-mini-4k": {**_MICROSOFT, "_name_or_path": "Phi-3-mini-4k-instruct", "max_position_embeddings": 4096,
                     "rope_scaling": None, "sliding_window": 2047, "transformers_version": "4.40.2"},
    "phi3.5-mini": {**_MICROSOFT, "_name_or_path": "Phi-3.5-mini-instruct", "max_position_embeddings": 131072,
                    "rope_scaling": {"long_factor": PHI35_MINI_LONG_FACTOR, "short_factor": PHI35_MINI_SHORT_FACTOR,
                                     "type": "longrope"},
                    "sliding_window": 262144, "transformers_version": "4.43.3"},
}
PUBLISHED_BILLIONS = {"phi3-mini-4k": 3.82, "phi3.5-mini": 3.82}  # the model cards' 3.8B


@pytest.mark.parametrize("name", list(RELEASED))
def test_presets_have_the_released_shapes_and_parameter_counts(name):
    cfg = Phi3Config.from_preset(name)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size) == (
        3072, 32, 32, 32, 8192, 32064)
    # the released config.json imports as the preset
    assert model_config_from_hf(RELEASED[name]) == dataclasses.replace(cfg, preset=None)
    # transformers' model of the preset's config.json, built on the meta device, has as many parameters
    written = hf_config_dict(cfg)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**written))
    assert type(theirs).__name__ == "Phi3ForCausalLM"
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())
    assert round(cfg.num_params() / 1e9, 2) == PUBLISHED_BILLIONS[name]
    if name == "phi3.5-mini":  # LongRoPE from 4096 to 131072, the paper's attention factor
        assert cfg.max_seq_len == 131072 and cfg.rope_original_max_seq_len == 4096 and cfg.rope_factor == 32.0
        assert cfg.sliding_window is None  # 262144, past the context: hides nothing
        assert theirs.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    else:
        assert cfg.max_seq_len == 4096 and cfg.sliding_window == 2047 and cfg.rope_scaling == "none"


# --------------------------------------------------------------------------- the fused HF layout


def test_state_dicts_split_and_join_qkv_proj_and_gate_up_proj_exactly():
    cfg = small(n_kv_heads=1, head_dim=32)  # q 4 x 32 rows, k and v 32 each: unequal pieces
    state = random_model(cfg).state_dict()
    hf = state_dict_to_hf(state, cfg)
    for i in range(cfg.n_layers):
        qkv = hf[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        assert qkv.shape == (128 + 32 + 32, 64)
        assert torch.equal(qkv, torch.cat([state[f"layers.{i}.attn.{w}.weight"] for w in ("wq", "wk", "wv")]))
        gate_up = hf[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up, torch.cat([state[f"layers.{i}.mlp.w1.weight"], state[f"layers.{i}.mlp.w3.weight"]]))
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)))
    assert hf.keys() == theirs.state_dict().keys()
    assert all(hf[k].shape == v.shape for k, v in theirs.state_dict().items())
    back = state_dict_from_hf(hf, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_a_joined_projection_of_the_wrong_width_is_refused_naming_it():
    cfg = small()
    hf = state_dict_to_hf(random_model(cfg).state_dict(), cfg)
    hf["model.layers.1.self_attn.qkv_proj.weight"] = hf["model.layers.1.self_attn.qkv_proj.weight"][:-16]
    with pytest.raises(KeyError, match=r"model.layers.1.self_attn.qkv_proj.weight has 112 rows; the config's q/k/v or "
                                       r"gate/up widths sum to 128"):
        state_dict_from_hf(hf, cfg)


def test_names_map_one_to_one_outside_the_joined_projections():
    cfg = small()
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)))
    hf_names = set(theirs.state_dict())
    for name in build(small()).state_dict():
        if name.split(".")[-2] in ("wq", "wk", "wv", "w1", "w3"):
            with pytest.raises(KeyError, match="part of Phi3ForCausalLM's joined"):
                phi3_hf.to_hf_name(name)
            continue
        assert phi3_hf.to_hf_name(name) in hf_names and phi3_hf.from_hf_name(phi3_hf.to_hf_name(name)) == name
    with pytest.raises(KeyError, match="no lmforge parameter"):
        phi3_hf.from_hf_name("model.layers.0.self_attn.qkv_proj.weight")


# --------------------------------------------------------------------------- config.json keys

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT8, "long_factor": LONG8, "rope_theta": 10000.0}
# key -> (what else the pair of configs sets, the value away from the default); the inputs are 32 tokens
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
    # LongRoPE past its original context of 16: the long factors and sqrt(1 + ln 4 / ln 16) on the 32 tokens
    "rope_parameters": ({"original_max_position_embeddings": 16}, LONGROPE),
    # transformers < 5's spelling (Phi-3.5-mini's config.json): "type", no factor (max / original = 4)
    "rope_scaling": ({"original_max_position_embeddings": 16}, {"type": "longrope", "short_factor": SHORT8,
                                                                "long_factor": LONG8}),
    "rope_theta": ({}, 300.0),
    # the pretraining context at the top level, over the default 4096: from short factors to long ones
    "original_max_position_embeddings": ({"rope_parameters": LONGROPE, "original_max_position_embeddings": 64}, 16),
    "sliding_window": ({}, 8),
    "attention_dropout": ({}, 0.1),
    "resid_pdrop": ({}, 0.1),
    "embd_pdrop": ({}, 0.1),
    "partial_rotary_factor": ({}, 0.5),
    "quantization_config": ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    "pruned_heads": ({}, {"0": [1]}),
    "auto_map": ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
}
DROPOUT = {"attention_dropout": "attn_dropout", "resid_pdrop": "resid_dropout", "embd_pdrop": "embed_dropout"}
NOT_ON_EVAL_LOGITS = {  # keys whose change a tiny model cannot show on its eval logits, and why
    "max_position_embeddings": "the context bound: no effect on a shorter input with plain RoPE; the import must keep it",
    **dict.fromkeys(DROPOUT, "acts in training only: the test checks transformers' train-mode logits (and lmforge's field)"),
    "quantization_config": "building a quantized model needs a quantization backend; the weights are not plain matrices",
    "pruned_heads": "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    "auto_map": "custom modelling code (trust_remote_code) computes the model; the test builds none",
}


def windowed_on_every_layer(ours: torch.nn.Module, model_type: str, key: str, value: object) -> None:
    if key == "sliding_window":
        assert ours.cfg.sliding_layers() == (True, True) and ours.cfg.sliding_window == value


# tests/model/families/test_hf_config_keys.py holds every key against transformers by this; Phi3Model defines
# embd_pdrop but applies no embedding dropout (the key's classification says so)
HF_KEYS = HfKeys(family="phi3", classes={"phi3": transformers.Phi3Config}, base={"phi3": BASE}, variants=VARIANTS,
                 not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=Phi3, inert_must_check=frozenset({"attention_bias"}),
                 dropouts=DROPOUT, unapplied_dropouts=frozenset({"embd_pdrop"}), check_import=windowed_on_every_layer)


def make_config(**fields) -> transformers.Phi3Config:
    return HF_KEYS.make_config("phi3", **fields)


def build_folder(path: Path, fields: dict, patch: dict) -> torch.nn.Module:
    return HF_KEYS.build_folder(path, "phi3", fields, patch)


def test_microsofts_own_auto_map_is_accepted_and_any_other_code_refused():
    config = make_config().to_dict()
    assert model_config_from_hf({**config, "auto_map": RELEASED["phi3-mini-4k"]["auto_map"]}) == model_config_from_hf(config)
    custom = {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    with pytest.raises(InputError, match=r"auto_map = .* is not supported \(custom modelling code"):
        model_config_from_hf({**config, "auto_map": custom})


@pytest.mark.parametrize("rope, named", [
    ({"rope_type": "linear", "factor": 2.0}, "RoPE scaling 'linear' is not supported for model_type 'phi3'"),
    ({"rope_type": "dynamic", "factor": 2.0}, "RoPE scaling 'dynamic' is not supported for model_type 'phi3'"),
    ({"rope_type": "longrope", "short_factor": SHORT8}, "RoPE scaling 'longrope' needs long_factor"),
])
def test_a_rope_type_phi3config_refuses_is_refused_in_one_line(rope, named):
    with pytest.raises(InputError, match=named) as info:
        model_config_from_hf({**make_config().to_dict(), "rope_scaling": rope}, where="x/config.json")
    assert str(info.value).startswith("x/config.json: ") and "\n" not in str(info.value)


# --------------------------------------------------------------------------- LongRoPE


@pytest.mark.parametrize("spelling", ["longrope", "su", "yarn"])
@pytest.mark.parametrize("attention_factor", [None, 1.3], ids=["paper-attention-factor", "own-attention-factor"])
def test_longrope_logits_equal_transformers_below_and_above_the_original_context(tmp_path, spelling, attention_factor):
    """Up to original_max_position_embeddings (16) both compute with the short factors, past it with the long ones;
    cos and sin scaled by sqrt(1 + ln(64 / 16) / ln 16) or the config's own attention_factor. The old names su
    and yarn carry an original context in rope_scaling too (transformers 5 loads them only so): the top-level
    one wins on both sides."""
    rope = {"type": spelling, "short_factor": SHORT8, "long_factor": LONG8}
    if spelling != "longrope":
        rope["original_max_position_embeddings"] = 64
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    build_folder(tmp_path / "hf", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16},
                 {"rope_scaling": rope, "original_max_position_embeddings": 16})
    theirs = from_folder(tmp_path / "hf")
    expected_factor = attention_factor or math.sqrt(1 + math.log(4) / math.log(16))
    assert theirs.model.rotary_emb.attention_scaling == pytest.approx(expected_factor)
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    cfg = ours.cfg
    assert (cfg.rope_scaling, cfg.rope_original_max_seq_len, cfg.rope_factor) == ("longrope", 16, 4.0)
    assert (cfg.rope_short_factor, cfg.rope_long_factor, cfg.rope_attention_factor) == (SHORT8, LONG8, attention_factor)
    short, long = TOKENS[:, :16], TOKENS
    for tokens in (short, long):
        assert (the_logits(ours, tokens) - the_logits(theirs, tokens)).abs().max().item() <= 1e-5
    # the two sets differ: the first 16 positions of the long input rotate by the long factors
    assert (the_logits(ours, long)[:, :16] - the_logits(ours, short)).abs().max().item() > 1e-3


def test_the_old_names_import_as_longrope_where_transformers_5_cannot_load_them(tmp_path):
    """Phi-3-mini-128k's first config.json: rope_scaling of type su, the original context at the top level only,
    as Microsoft's modeling_phi3 and transformers 4 read it; transformers 5 renames su to longrope after
    filling the context in, so it refuses the folder. lmforge computes the longrope folder's logits."""
    theirs = build_folder(tmp_path / "longrope", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16}, {})
    build_folder(tmp_path / "su", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16},
                 {"rope_scaling": {"type": "su", "short_factor": SHORT8, "long_factor": LONG8}})
    with pytest.raises(KeyError, match="original_max_position_embeddings"):
        from_folder(tmp_path / "su")
    run_import(ImportRecipe(hf_dir=str(tmp_path / "su"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert (ours.cfg.rope_scaling, ours.cfg.rope_original_max_seq_len) == ("longrope", 16)
    assert (logits(ours) - logits(theirs)).abs().max().item() <= 1e-5


def test_export_of_longrope_with_a_head_dim_phi3config_cannot_count_is_refused_in_one_line(tmp_path):
    """transformers' Phi3Config counts LongRoPE's factors by hidden_size / num_attention_heads, its attention by
    head_dim: no config.json computes LongRoPE on heads of another width, so neither export nor import writes one."""
    short, long = [1.0 + 0.25 * i for i in range(16)], [1.0 + i for i in range(16)]
    cfg = small(head_dim=32, rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=16,
                rope_short_factor=short, rope_long_factor=long)
    with pytest.raises(ValueError, match=r"head_dim = 32 .* d_model / n_heads = 16") as info:
        hf_config_dict(cfg)
    assert "\n" not in str(info.value)
    config = {**make_config().to_dict(), "head_dim": 32, "original_max_position_embeddings": 16,
              "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long}}
    with pytest.raises(InputError, match=r"^x/config.json: .*head_dim = 32") as info:
        model_config_from_hf(config, where="x/config.json")
    assert "\n" not in str(info.value)
    with pytest.raises(Exception, match="short_factor field must have length 8"):  # transformers refuses it too
        transformers.Phi3Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    model = random_model(cfg)
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    with pytest.raises(InputError, match="cannot export to Hugging Face format: .*head_dim = 32"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- lmforge import / export


@pytest.mark.parametrize("fields", [
    dict(),
    dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=32),
    dict(sliding_window=8),
    dict(rope_parameters=LONGROPE, original_max_position_embeddings=16),
], ids=["plain", "tied-mqa-head-dim", "sliding-window", "longrope"])
def test_cli_import_then_export_round_trips_transformers_model_and_logits(tmp_path, fields):
    theirs = build_folder(tmp_path / "hf", fields, {})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    expected = logits(theirs)
    assert (logits(ours) - expected).abs().max().item() <= 1e-5

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Phi3ForCausalLM"] and exported["model_type"] == "phi3"
    again = from_folder(tmp_path / "out")
    assert (logits(again) - expected).abs().max().item() <= 1e-5
    # the split q/k/v and gate/up joined again: the very tensors transformers saved
    original, written = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    assert model_config_from_hf(exported) == dataclasses.replace(ours.cfg, preset=None)


# --------------------------------------------------------------------------- training, LoRA, checkpoints


def test_pretraining_a_phi3_lowers_the_loss(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    recipe = load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        tmp_path / "run", shards_dir, small_tokenizer_dir, **{"model.family": "phi3", "train.lr": 1e-2}))
    assert type(recipe.model) is Phi3Config
    run_pretrain(recipe)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    model, _ = load_model(tmp_path / "run")
    assert type(model) is Phi3 and model.cfg.family == "phi3"


@torch.no_grad()
def test_lora_applies_to_every_projection_and_merges_into_the_same_logits():
    cfg = small()
    model = random_model(cfg)
    base = logits(model)
    wrapped = apply_lora(model, LoraConfig(r=4, alpha=8))
    assert len(wrapped) == 7 * cfg.n_layers and set(lora_modules(model)) == set(wrapped)  # q k v o w1 w2 w3 per block
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert torch.equal(logits(model), base)  # B starts at zero
    for name, p in model.named_parameters():
        assert p.requires_grad == name.endswith(("lora_A.weight", "lora_B.weight"))
        if name.endswith("lora_B.weight"):
            p.normal_(0.0, 0.05)  # a trained adapter: B away from zero
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3
    merge_lora(model)
    assert not lora_modules(model)
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)
    # the merged q/k/v and gate/up, joined, are transformers' model of the same logits
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)),
                                                           attn_implementation="eager").eval()
    theirs.load_state_dict(state_dict_to_hf(model.state_dict(), cfg))
    torch.testing.assert_close(logits(theirs), adapted, atol=1e-5, rtol=0)


def test_a_peft_adapter_of_a_phi3_names_phi3s_modules_or_is_refused(tmp_path):
    """PEFT applies an adapter by module name to the exported Phi3ForCausalLM: on q/k/v or gate/up, which are
    joined there and have no module of their own, saving is refused in one line naming the joined projection;
    on the output projections it names Phi3ForCausalLM's own modules, and loads back into the same adapter."""
    from lmforge.peft.adapters import load_adapter, peft_unsupported, save_adapter

    model = random_model(small())
    lora = LoraConfig(r=4, alpha=8)
    apply_lora(model, lora)
    with pytest.raises(ValueError, match=r"joined self_attn.qkv_proj|joined mlp.gate_up_proj") as refused:
        save_adapter(model, lora, tmp_path / "all")
    assert "\n" not in str(refused.value) and peft_unsupported(model) in str(refused.value)
    assert not (tmp_path / "all").exists()

    model = random_model(small())
    lora = LoraConfig(r=4, alpha=8, target_modules=["wo", "w2"])
    apply_lora(model, lora)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.05)
    assert peft_unsupported(model) is None
    save_adapter(model, lora, tmp_path / "out")
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(model.cfg)))
    names = {n.rsplit(".", 1)[-1] for n, _ in theirs.named_modules()}
    targets = json.loads((tmp_path / "out" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["down_proj", "o_proj"] and set(targets) <= names
    again = random_model(small())
    again.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k}, strict=False)
    assert sorted(load_adapter(again, tmp_path / "out")) == sorted(lora_modules(model))
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)


def test_a_checkpoint_round_trips_the_family_config_and_weights(tmp_path):
    cfg = small(tie_embeddings=True, sliding_window=8, rope_scaling="longrope", rope_factor=4.0,
                rope_original_max_seq_len=16, rope_attention_factor=1.1, rope_short_factor=SHORT8, rope_long_factor=LONG8,
                resid_dropout=0.1)
    model = random_model(cfg)
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    assert json.loads((tmp_path / "ckpt" / "model.json").read_text())["family"] == "phi3"
    loaded, _ = load_model(tmp_path / "ckpt")
    assert type(loaded) is Phi3 and loaded.cfg == cfg
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(loaded), logits(model))
