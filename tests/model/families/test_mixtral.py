"""The mixture-of-experts family (``lmforge.model.families.mixtral``) against transformers' ``MixtralForCausalLM``
and ``Qwen3MoeForCausalLM``: its parity variants (tests/model/test_parity.py runs them through training, cached
decoding, a pipeline split and HF export), every config.json key classified and held to transformers' logits,
``lmforge import`` / ``lmforge export`` both ways, bad folders and configs, counts, LoRA and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import atomic_directory
from lmforge.model.families import build, model_config
from lmforge.model.families.mixtral import Mixtral, MixtralConfig
from lmforge.model.families.mixtral.hf import to_hf_name
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_to_hf
from lmforge.model.moe import MoE, MoEConfig
from lmforge.model.transformer import MLP
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules, merge_lora
from lmforge.stages.pretrain import PretrainRecipe
from tests.model.families.hf_keys import INERT_SAMPLES, HfKeys, from_folder, logits, randomize_

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

MOE = dict(n_experts=4, n_experts_per_token=2)
# test_parity.py's BASE (4 layers, width 64, 4 heads, ffn 96, vocabulary 256) with these fields
PARITY_VARIANTS = {
    "mixtral:top2": dict(family="mixtral", n_kv_heads=2, moe=MOE),
    "mixtral:top1-window-tied": dict(family="mixtral", n_kv_heads=1, head_dim=32, sliding_window=6, tie_embeddings=True,
                                     moe=dict(n_experts=3, n_experts_per_token=1)),
    # training-only keys: a capacity and every balancing loss change no logits of evaluation or decoding
    "mixtral:capacity-aux-losses": dict(family="mixtral", n_kv_heads=2, norm_eps=1e-6, moe={
        **MOE, "capacity_factor": 1.25, "aux_loss_coef": 0.01, "seq_aux_loss_coef": 0.001, "z_loss_coef": 0.001}),
    # Qwen3-MoE: QK-norm, narrow experts, unnormalised weights, dense layers by both of its rules
    "mixtral:qwen3-moe": dict(family="mixtral", qk_norm=True, n_kv_heads=2, moe={
        "n_experts": 6, "n_experts_per_token": 3, "expert_ffn_hidden": 32, "norm_topk_prob": False, "dense_layers": [2]}),
    "mixtral:qwen3-moe-sparse-step-bias-window": dict(family="mixtral", qk_norm=True, qkv_bias=True, out_bias=True,
                                                      sliding_window=5, moe={**MOE, "sparse_step": 2}),
    "mixtral:first-dense-llama3-rope": dict(family="mixtral", qk_norm=True, rope_scaling="llama3", rope_factor=8.0,
                                            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                                            rope_original_max_seq_len=16, moe={**MOE, "first_dense_layers": 1}),
    # DeepSeek-V3's routing in these blocks: no Mixtral or Qwen3-MoE class computes it (family deepseek_v3's does)
    "mixtral:deepseek-routing": dict(family="mixtral", n_kv_heads=2, moe={
        "n_experts": 8, "n_experts_per_token": 3, "expert_ffn_hidden": 16, "scores": "sigmoid", "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 2, "bias_update_rate": 0.001}),
    "mixtral:selection-bias": dict(family="mixtral", moe={**MOE, "selection_bias": True}),
    # every expert chosen: no top-k choice a 16-bit rounding could flip, so the 16-bit routes are compared too
    "mixtral:every-expert-mup": dict(family="mixtral", mup={"base_width": 16, "base_head_dim": 4}, n_kv_heads=2,
                                     moe=dict(n_experts=3, n_experts_per_token=3)),
    "mixtral:yarn-rope": dict(family="mixtral", rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64,
                              rope_beta_fast=4.0, rope_beta_slow=0.5, rope_mscale=1.0, rope_mscale_all_dim=0.5,
                              rope_truncate=False, n_kv_heads=2, head_dim=32, moe=MOE),
    "mixtral:yarn-attention-factor": dict(family="mixtral", rope_scaling="yarn", rope_factor=8.0,
                                          rope_original_max_seq_len=16, rope_attention_factor=1.2, moe=MOE),
    "mixtral:longrope": dict(family="mixtral", qk_norm=True, rope_scaling="longrope", rope_factor=4.0,
                             rope_original_max_seq_len=2, rope_short_factor=[1.0 + 0.5 * i for i in range(8)],
                             rope_long_factor=[1.0 + 2.0 * i for i in range(8)], n_kv_heads=2, moe=MOE),
}
PARITY_HF_REFUSED = {
    "mixtral:deepseek-routing": "route by softmax without shared experts",
    "mixtral:selection-bias": "selection_bias=True",
}
# Top-k routing is discontinuous: where two experts' scores lie within a 16-bit rounding of each other, the routes'
# roundings of the router's input (a batched prefill against one row's forward, transformers' against ours) may
# choose different experts, and the logits then differ by a whole expert's output, which no rounding bound covers.
# These variants are compared in float32 only (every-expert's 16-bit routes are compared: it chooses all).
PARITY_FLOAT32_ONLY = {name: "top-k routing flips on a 16-bit rounding of a near tie" for name, v in PARITY_VARIANTS.items()
                       if v["moe"]["n_experts_per_token"] < v["moe"]["n_experts"]}
# MoEConfig fields no variant above can show on logits of evaluation (the parity test's), and why
MOE_TRAINING_ONLY = {
    "capacity_factor": "drops assignments in training only (evaluation and decoding are dropless): "
                       "test_moe.py's capacity test",
    "aux_loss_coef": "a training loss: test_moe.py, and the pretraining test here",
    "seq_aux_loss_coef": "a training loss: test_moe.py",
    "z_loss_coef": "a training loss: test_moe.py",
    "bias_update_rate": "moves the selection bias after optimizer steps: test_moe.py's tracker tests",
}


def hf_in_memory(state: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    """Our export's per-expert matrices (the Hub's layout) as transformers 5 holds them once loaded:
    ``mlp.experts.gate_up_proj`` (E, 2f, d) and ``down_proj`` (E, d, f), Mixtral's module renamed ``mlp``."""
    out, experts = {}, {}
    for k, v in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", k)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = v
        else:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = v
    for layer, by_name in experts.items():
        gate, up, down = (("w1", "w3", "w2") if "w1" in by_name else ("gate_proj", "up_proj", "down_proj"))
        n = len(by_name[gate])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((by_name[gate][e], by_name[up][e])) for e in range(n)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([by_name[down][e] for e in range(n)])
    return out


PARITY_HF_IN_MEMORY = {"mixtral": hf_in_memory}

SMALL = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64)


def small(**changes) -> MixtralConfig:
    return model_config({"family": "mixtral", **SMALL, "moe": MOE, **changes})


# --------------------------------------------------------------------------- the model


def test_every_moe_field_is_in_a_parity_variant_or_training_only():
    covered = {k for v in PARITY_VARIANTS.values() for k in v.get("moe", {})}
    missing = [f.name for f in fields(MoEConfig) if f.name not in covered and f.name not in MOE_TRAINING_ONLY]
    assert missing == []


def test_the_family_builds_moe_blocks_on_the_sparse_layers_and_dense_mlps_on_the_others():
    cfg = small(n_layers=6, moe={**MOE, "first_dense_layers": 1, "sparse_step": 2, "dense_layers": [5]})
    assert cfg.sparse_layers() == (False, True, False, True, False, False)
    model = build(cfg)
    assert type(model) is Mixtral
    assert [type(b.mlp) for b in model.layers] == [MLP, MoE, MLP, MoE, MLP, MLP]
    moe = model.layers[1].mlp
    assert moe.experts.w1.shape == (4, 96, 64) and moe.experts.w2.shape == (4, 64, 96)  # ffn_hidden by default
    assert moe.layer == 1 and moe.router.expert_bias is None


@pytest.mark.parametrize("override, named", [
    ("model.moe.n_experts_per_token=9", "model.moe.n_experts_per_token = 9 must be at most model.moe.n_experts = 8"),
    ("model.moe.capacity_factor=0", "'model.moe.capacity_factor' = 0: must be > 0"),
    ("model.moe.capacity_factor=-1.5", "'model.moe.capacity_factor' = -1.5: must be > 0"),
    ("model.moe.dense_layers=[7]", "model.moe.dense_layers names layer 7, past the model's n_layers = 4"),
])
def test_a_bad_moe_recipe_is_one_line_naming_the_key(tmp_path, override, named):
    with pytest.raises(ConfigError) as info:
        load_config(PretrainRecipe, None, ["model.preset=mixtral-tiny", override, f"run_dir={tmp_path}"])
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_bad_moe_key_on_the_command_line_exits_2_writing_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", "recipes/demo/pretrain.yaml", "model.preset=mixtral-tiny",
                 "model.moe.n_experts_per_token=9", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.moe.n_experts_per_token = 9" in err[0]
    assert not run.exists()


def test_tensor_parallelism_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^tensor parallelism does not support model family 'mixtral'.*parallel.tp = 1"):
        build(small()).tp_plan(None)


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.70, 12.88), ("qwen3-moe-30b-a3b", 30.53, 3.35)])
def test_presets_have_the_released_models_total_and_active_parameters(name, total, active):
    """Mixtral 8x7B: 46.7B parameters, 12.9B active (its paper); Qwen3-30B-A3B: 30.5B, 3.3B active (its model
    card). Active = the matmul weights a token uses (attention, router, k experts, the head) plus the embedding."""
    cfg = MixtralConfig.from_preset(name)
    counts = cfg.param_counts()
    assert round(cfg.num_params() / 1e9, 2) == total
    assert round((counts.matmul + counts.embedding + counts.final_norm
                  + sum(layer.norms for layer in counts.layers)) / 1e9, 2) == active


# --------------------------------------------------------------------------- config.json keys

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)
CLASS_BASE = {"mixtral": dict(num_local_experts=4, head_dim=16), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32)}
CLASS_CONFIGS = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}
# (model_type or "*", key) -> (what else the pair of configs sets, the value away from the default); 32 tokens
VARIANTS: dict[tuple[str, str], tuple[dict, object]] = {
    ("*", "vocab_size"): ({}, 301),
    ("*", "hidden_size"): ({}, 96),
    ("*", "intermediate_size"): ({}, 64),
    ("*", "num_hidden_layers"): ({}, 3),
    ("*", "num_attention_heads"): ({}, 8),
    ("*", "num_key_value_heads"): ({}, 1),
    ("*", "head_dim"): ({}, 32),
    ("*", "rms_norm_eps"): ({}, 0.5),
    ("*", "tie_word_embeddings"): ({}, True),
    ("*", "max_position_embeddings"): ({}, 128),
    ("*", "hidden_act"): ({}, "gelu"),
    ("*", "rope_parameters"): ({}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ("*", "rope_scaling"): ({}, {"type": "linear", "factor": 4.0}),
    ("*", "rope_theta"): ({}, 300.0),
    ("*", "original_max_position_embeddings"): (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, 16),
    ("*", "attention_dropout"): ({}, 0.1),
    ("*", "num_experts_per_tok"): ({}, 1),
    ("*", "num_local_experts"): ({}, 3),
    ("*", "num_experts"): ({}, 3),
    ("*", "output_router_logits"): ({"router_aux_loss_coef": 0.02}, True),
    ("*", "router_aux_loss_coef"): ({"output_router_logits": True}, 0.05),
    ("*", "partial_rotary_factor"): ({}, 0.5),
    ("*", "quantization_config"): ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("*", "pruned_heads"): ({}, {"0": [1]}),
    ("*", "auto_map"): ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
    ("mixtral", "sliding_window"): ({}, 8),
    ("mixtral", "router_jitter_noise"): ({}, 0.1),
    ("qwen3_moe", "sliding_window"): ({"use_sliding_window": True}, 8),
    ("qwen3_moe", "use_sliding_window"): ({"sliding_window": 8}, True),
    ("qwen3_moe", "moe_intermediate_size"): ({}, 48),
    ("qwen3_moe", "intermediate_size"): ({"mlp_only_layers": [0]}, 64),  # the dense layers' width
    ("qwen3_moe", "norm_topk_prob"): ({}, True),
    ("qwen3_moe", "decoder_sparse_step"): ({}, 2),
    ("qwen3_moe", "mlp_only_layers"): ({}, [0]),
    ("qwen3_moe", "attention_bias"): ({}, True),
}
NOT_ON_EVAL_LOGITS = {  # keys whose change a tiny model cannot show on its eval logits, and why
    "max_position_embeddings": "the context bound: no effect on a shorter input with plain RoPE; the import keeps it",
    "attention_dropout": "acts in training only: lmforge's attn_dropout field is checked",
    "output_router_logits": "adds the balancing loss in training only: lmforge's aux_loss_coef is checked",
    "router_aux_loss_coef": "the balancing loss's coefficient in training only: lmforge's aux_loss_coef is checked",
    "router_jitter_noise": "noise in training only",
    "partial_rotary_factor": "transformers 5's Mixtral and Qwen3-MoE rotate whole heads whatever it says; lmforge refuses "
                             "it as the Llama line does",
    "quantization_config": "building a quantized model needs a quantization backend; the weights are not plain matrices",
    "pruned_heads": "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    "auto_map": "custom modelling code (trust_remote_code) computes the model; the test builds none",
    "num_experts": "MixtralConfig's alias of num_local_experts, Qwen3MoeConfig's own: whichever the class reads",
    "num_local_experts": "the other name of num_experts",
}


def routed_as_the_class_routes(ours: torch.nn.Module, model_type: str, key: str, value: object) -> None:
    assert ours.cfg.qk_norm == (model_type == "qwen3_moe")
    if key in ("output_router_logits", "router_aux_loss_coef"):
        assert ours.cfg.moe.aux_loss_coef == {"output_router_logits": 0.02, "router_aux_loss_coef": 0.05}[key]


# tests/model/families/test_hf_config_keys.py holds every key of both classes against transformers by this
HF_KEYS = HfKeys(family="mixtral", classes=CLASS_CONFIGS, base={t: {**BASE, **b} for t, b in CLASS_BASE.items()},
                 variants=VARIANTS, not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=Mixtral,
                 inert_samples={**INERT_SAMPLES, "layer_types": ["full_attention"] * 2}, min_inert_checked=8,
                 unknown_key=("n_shared_experts", 1), in_memory=lambda weights: hf_in_memory(weights, None),
                 check_import=routed_as_the_class_routes)


def make_config(model_type: str, **changes) -> transformers.PretrainedConfig:
    return HF_KEYS.make_config(model_type, **changes)


def build_folder(path: Path, model_type: str, changes: dict, patch: dict) -> torch.nn.Module:
    """A random model of ``changes`` saved by transformers (the Hub's per-expert layout), its config.json then
    holding ``patch`` verbatim."""
    return HF_KEYS.build_folder(path, model_type, changes, patch)


# --------------------------------------------------------------------------- import and export


@pytest.mark.parametrize("model_type, changes", [
    ("mixtral", {}),
    ("mixtral", dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=32, sliding_window=8)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], attention_bias=True)),
], ids=["mixtral", "mixtral-tied-mqa-window", "qwen3-moe", "qwen3-moe-dense-layer-bias"])
def test_cli_import_then_export_round_trips_transformers_model_and_logits(tmp_path, model_type, changes):
    theirs = build_folder(tmp_path / "hf", model_type, changes, {})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    expected = logits(theirs)
    assert (logits(ours) - expected).abs().max().item() <= 1e-5

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == model_type
    again = from_folder(tmp_path / "out")
    assert (logits(again) - expected).abs().max().item() <= 1e-5
    # the Hub's per-expert layout, the very tensors transformers saved
    original, written = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    assert model_config_from_hf(exported) == dataclasses.replace(ours.cfg, preset=None)


def test_transformers_5s_fused_expert_layout_imports_too(tmp_path):
    theirs = build_folder(tmp_path / "hf", "mixtral", {}, {})
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file(hf_in_memory(weights, None), str(tmp_path / "hf" / "model.safetensors"))  # gate_up_proj, down_proj
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert (logits(ours) - logits(theirs)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("damage, named", [
    (lambda w: w.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"), r"layer 1's experts .*: expert 3 missing"),
    (lambda w: w.update({"model.layers.0.block_sparse_moe.experts.2.w1.weight": torch.zeros(95, 64)}),
     r"model.layers.0.block_sparse_moe.experts.2.w1.weight has shape \(95, 64\), unlike"),
    (lambda w: [w.pop(k) for k in list(w) if ".experts." in k and ".layers.0." in k],
     r"weights do not match the model config: missing \['layers.0.mlp.experts.w1'"),
    (lambda w: [w.update({k: v[:48]}) for k, v in list(w.items()) if ".experts." in k and k.endswith("w1.weight")],
     r"wrong shapes \['layers.0.mlp.experts.w1 \(4, 48, 64\) \(config says \(4, 96, 64\)\)"),
], ids=["one-expert-missing", "one-expert-mis-shaped", "a-layers-experts-missing", "every-expert-mis-shaped"])
def test_an_hf_folder_with_missing_or_mis_shaped_expert_tensors_exits_2_naming_it(tmp_path, capsys, damage, named):
    build_folder(tmp_path / "hf", "mixtral", {}, {})
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    damage(weights)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    capsys.readouterr()  # transformers' progress bars
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "hf") in err[0] and re.search(named, err[0]), err
    assert not (tmp_path / "ckpt").exists()


def test_export_of_a_routing_no_hf_class_computes_is_refused_in_one_line(tmp_path):
    cfg = small(moe={**MOE, "scores": "sigmoid"})
    with pytest.raises(ValueError, match=r"model.moe scores='sigmoid': MixtralForCausalLM and Qwen3MoeForCausalLM route "
                                         r"by softmax") as info:
        hf_config_dict(cfg)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"MixtralForCausalLM has no dense layers.*set qk_norm"):
        hf_config_dict(small(moe={**MOE, "first_dense_layers": 1}))


# --------------------------------------------------------------------------- LoRA, checkpoints


@torch.no_grad()
def test_lora_adapts_attention_and_the_dense_layers_and_merges_into_the_same_logits():
    cfg = small(n_layers=3, moe={**MOE, "dense_layers": [0]})
    model = randomize_(build(cfg))
    base = logits(model)
    wrapped = apply_lora(model, LoraConfig(r=4, alpha=8))
    # q k v o on every block, w1 w2 w3 on the dense one; the stacked experts are no nn.Linear
    assert len(wrapped) == 4 * 3 + 3 and not any(".experts" in n or ".router" in n for n in wrapped)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".experts." in n or ".router." in n)
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            p.normal_(0.0, 0.05)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3
    merge_lora(model)
    assert not lora_modules(model)
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"matched no nn.Linear"):
        apply_lora(randomize_(build(cfg)), LoraConfig(target_modules=["experts"]))
    assert to_hf_name("layers.0.attn.wq.weight") == "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(KeyError, match="the routed FFN"):
        to_hf_name("layers.1.mlp.router.weight")


def test_a_checkpoint_round_trips_the_family_config_weights_and_selection_bias(tmp_path):
    cfg = small(moe={**MOE, "bias_update_rate": 1e-3, "capacity_factor": 2.0})
    model = randomize_(build(cfg))
    with torch.no_grad():
        model.layers[1].mlp.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    loaded, _ = load_model(tmp_path / "ckpt")
    assert type(loaded) is Mixtral and loaded.cfg == cfg and isinstance(loaded.cfg.moe, MoEConfig)
    assert torch.equal(loaded.layers[1].mlp.router.expert_bias, model.layers[1].mlp.router.expert_bias)
    assert torch.equal(logits(loaded), logits(model))
    with pytest.raises(ValueError, match="bias_update_rate=0.001"):
        state_dict_to_hf(model.state_dict(), cfg) and hf_config_dict(cfg)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("moe", [dict(n_experts=8, n_experts_per_token=2, expert_ffn_hidden=192),
                                 dict(n_experts=4, n_experts_per_token=1, n_shared_experts=1, expert_ffn_hidden=384,
                                      dense_layers=[0])], ids=["fine-grained-top2", "top1-shared-dense-first"])
def test_the_memory_plan_holds_every_expert_and_matches_a_measured_step(monkeypatch, precision, moe):
    """``lmforge plan memory`` against torch's MemTracker over one training step, as tests/distributed/test_memory.py
    holds the dense model: every expert's weights, gradients and AdamW state, and the activations of the k experts
    a token goes through (``MixtralConfig.ffn_activation_bytes``) within the dense plan's 20%."""
    import tests.distributed.test_memory as memory_tests
    from lmforge.distributed.config import ParallelConfig
    from lmforge.distributed.memory import plan_memory
    from lmforge.distributed.mesh import Layout

    cfg = model_config(dict(family="mixtral", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                            ffn_hidden=384, max_seq_len=128, moe=moe))
    monkeypatch.setattr(memory_tests, "Transformer", build)  # its measurement of a family's model
    measured = memory_tests.measured_peak(cfg, 4, 128, precision, False)
    plan = plan_memory(cfg, ParallelConfig(), Layout(), micro_batch_size=4, seq_len=128, precision=precision,
                       activation_checkpointing=False)
    assert plan.detail["master_weights"] == measured["PARAM"] == 4 * cfg.num_params()
    assert plan.gradients == 4 * cfg.num_params()
    assert plan.activations + plan.detail["compute_copies"] == pytest.approx(measured["ACT"] + measured["TEMP"], rel=0.2)
    assert measured["Total"] <= plan.total <= 1.3 * measured["Total"]
