"""The DeepSeek-V3 family (``lmforge.model.families.deepseek_v3``) against transformers'
``DeepseekV3ForCausalLM``: its parity variants (tests/model/test_parity.py runs them through training,
cached decoding on the latent cache, a pipeline split and HF export), every config.json key classified
and held to transformers' logits, ``lmforge import`` / ``lmforge export`` both ways, the engine's greedy
generation, LoRA, tensor parallelism's plan, training and its refusals."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.inference.engine import GenerationConfig, generate
from lmforge.model.families import build, model_config
from lmforge.model.families.deepseek_v3 import DeepseekV3, DeepseekV3Config
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_to_hf, to_hf_name
from lmforge.model.mla import MLA, rotate_interleaved
from lmforge.model.transformer import apply_rope, rotation_tables
from lmforge.peft.lora import LoraConfig, apply_lora, merge_lora
from lmforge.stages.import_hf import ImportRecipe, run_import
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.model.families.hf_keys import INERT_SAMPLES, HfKeys, from_folder, logits, randomize_
from tests.model.families.test_mixtral import hf_in_memory
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

# every layer dense: the attention variants are compared in 16 bits too (a routed layer's top-k is not)
_MLA = dict(family="deepseek_v3", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            moe={"first_dense_layers": 4})
# DeepSeek-V3's routed FFN on layers 1-3: sigmoid scores, the best 2 of 4 groups, one shared expert, scaled weights
_ROUTED = dict(n_experts=8, n_experts_per_token=2, expert_ffn_hidden=32, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5, first_dense_layers=1)
# test_parity.py's BASE (4 layers, width 64, 4 heads, vocabulary 256) with these fields
PARITY_VARIANTS = {
    "deepseek_v3:moe": dict(_MLA, q_lora_rank=24, moe=_ROUTED),
    # every expert chosen (so 16-bit routes agree), unnormalised and unscaled, no shared expert, no dense layer
    "deepseek_v3:moe-every-expert": dict(_MLA, moe=dict(n_experts=4, n_experts_per_token=4, expert_ffn_hidden=16,
                                                        norm_topk_prob=False, routed_scaling_factor=1.0,
                                                        n_shared_experts=0, first_dense_layers=0)),
    "deepseek_v3:q-lora-biases": dict(_MLA, q_lora_rank=24, qkv_bias=True, out_bias=True, norm_eps=1e-5),
    "deepseek_v3:halves-tied": dict(_MLA, rope_interleave=False, tie_embeddings=True),
    "deepseek_v3:mup": dict(_MLA, mup={"base_width": 16}),  # µP's readout multiplier, folded into the final norm
    # every YaRN key shapes the tables (test_parity's yarn-rope) and mscale_all_dim the scores' scale
    "deepseek_v3:yarn-mscale": dict(_MLA, qk_rope_head_dim=16, rope_scaling="yarn", rope_factor=4.0,
                                    rope_original_max_seq_len=64, rope_beta_fast=4.0, rope_beta_slow=0.5,
                                    rope_mscale=1.0, rope_mscale_all_dim=0.5, rope_truncate=False),
    "deepseek_v3:yarn-attention-factor": dict(_MLA, q_lora_rank=16, rope_scaling="yarn", rope_factor=8.0,
                                              rope_original_max_seq_len=16, rope_attention_factor=1.2,
                                              rope_mscale=1.0, rope_mscale_all_dim=1.0),
    "deepseek_v3:llama3-rope": dict(_MLA, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                                    rope_high_freq_factor=4.0, rope_original_max_seq_len=16),
    # every forward past the original context of 2: the long factors, in training and each decoding step
    "deepseek_v3:longrope": dict(_MLA, rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=2,
                                 rope_short_factor=[1.0, 1.5, 2.0, 2.5], rope_long_factor=[1.0, 3.0, 5.0, 7.0]),
}
PARITY_HF_IN_MEMORY = {"deepseek_v3": hf_in_memory}  # the per-expert export as transformers 5 fuses it on loading
PARITY_FLOAT32_ONLY = {"deepseek_v3:moe": "top-k routing flips on a 16-bit rounding of a near tie (test_mixtral.py)"}
PARITY_NOT_ARITHMETIC = {"deepseek_v3": {
    "head_dim": "always qk_rope_head_dim (refused at any other value), which the variants vary",
    "n_kv_heads": "always n_heads (refused at any other value): every head reads its own keys and values",
}}

SMALL = dict(family="deepseek_v3", vocab_size=300, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe={"first_dense_layers": 2})
ROUTED = dict(n_experts=8, n_experts_per_token=2, expert_ffn_hidden=16, n_group=2, topk_group=1, first_dense_layers=1)


def small(**fields) -> DeepseekV3Config:
    return model_config({**SMALL, **fields})


def random_model(cfg: DeepseekV3Config) -> DeepseekV3:
    """Norm gains and biases random too, so a mis-mapped one shows; the same values at every call."""
    return randomize_(build(cfg))


# --------------------------------------------------------------------------- the model


def test_the_family_builds_blocks_of_multi_head_latent_attention():
    model = build(small(q_lora_rank=24))
    assert type(model) is DeepseekV3
    attn = model.layers[0].attn
    assert isinstance(attn, MLA) and attn.wq is None
    shapes = {n: tuple(p.shape) for n, p in attn.named_parameters()}
    assert shapes == {"wq_a.weight": (24, 64), "q_a_norm.weight": (24,), "wq_b.weight": (4 * 24, 24),
                      "wkv_a.weight": (32 + 8, 64), "kv_a_norm.weight": (32,), "wkv_b.weight": (4 * (16 + 12), 32),
                      "wo.weight": (64, 4 * 12)}
    assert build(small()).layers[0].attn.wq.weight.shape == (4 * 24, 64)
    assert model.layers[0].attn.rotate is rotate_interleaved and build(small(rope_interleave=False)).layers[0].attn.rotate \
        is apply_rope


def test_the_interleaved_rotation_turns_each_adjacent_pair_as_one_complex_number():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    angles = torch.rand(5, 4, dtype=torch.float64) * 6
    cos, sin = angles.cos()[None], angles.sin()[None]
    got = rotate_interleaved(x, rotation_tables(cos, sin))
    pairs = torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous()) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.view_as_real(pairs)  # (x_2i, x_2i+1) rotated, as halves: the real parts, then the imaginary
    torch.testing.assert_close(got, torch.cat((expected[..., 0], expected[..., 1]), dim=-1), rtol=0, atol=1e-12)


def test_the_attention_flops_count_query_key_and_value_widths():
    cfg = small()
    # 6·L·H·(qk + v)·T: scores over the 24-wide q and k heads, weighted sums of the 12-wide values
    assert cfg.flops_per_token(32) - 6 * cfg.matmul_params() == 6 * 2 * 4 * (24 + 12) * 32


@pytest.mark.parametrize("fields, named", [
    (dict(norm="layernorm"), "norm = 'layernorm' is not supported by family 'deepseek_v3': DeepSeek-V3's norms are RMSNorm"),
    (dict(ffn="gelu"), "ffn = 'gelu' is not supported by family 'deepseek_v3'"),
    (dict(positions="alibi"), "positions = 'alibi' is not supported by family 'deepseek_v3'"),
    (dict(qk_norm=True), "qk_norm = True is not supported by family 'deepseek_v3'"),
    (dict(sliding_window=8), "sliding_window = 8 is not supported by family 'deepseek_v3'"),
    (dict(head_dim=16), "head_dim = 16 is not supported by family 'deepseek_v3': it is the RoPE part of a head"),
    (dict(n_kv_heads=2), "n_kv_heads = 2 is not supported by family 'deepseek_v3'"),
    (dict(qkv_bias=True), "qkv_bias = True with out_bias = False is not supported by family 'deepseek_v3'"),
    (dict(kv_lora_rank=65), "kv_lora_rank = 65 is larger than d_model = 64"),
    (dict(q_lora_rank=96), "q_lora_rank = 96 is larger than d_model = 64"),
    (dict(mup={"base_width": 16, "base_head_dim": 4}), "mup.base_head_dim is not supported by family 'deepseek_v3'"),
])
def test_a_field_deepseek_v3_does_not_compute_is_refused_in_one_line(fields, named):
    with pytest.raises(ValueError) as info:
        small(**fields)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_latent_wider_than_the_model_is_one_line_naming_the_key_and_exit_2(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"kv_lora_rank = 512 is larger than d_model = 384"):
        load_config(PretrainRecipe, None, ["model.preset=deepseek-v3-tiny", "model.kv_lora_rank=512", f"run_dir={tmp_path}"])
    assert main(["pretrain", "model.preset=deepseek-v3-tiny", "model.kv_lora_rank=512", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "kv_lora_rank = 512 is larger than d_model = 384" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_the_engine_generates_greedily_what_the_full_forward_would_choose():
    model = random_model(small(q_lora_rank=24))
    prompts = [[1, 17, 45, 200, 8], [3, 9]]  # different lengths: left padding in the latent cache
    out = generate(model, prompts, GenerationConfig(max_new_tokens=6, temperature=0.0, stop_token_ids=[]))
    for prompt, generation in zip(prompts, out):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert generation.tokens == tokens[len(prompt):]


def test_tensor_parallelism_splits_whole_heads():
    model = build(small(q_lora_rank=24))
    plan = model.tp_plan(model.layers[0])
    assert {n for n, role in plan.items() if role == "colwise"} == {"attn.wq_b", "attn.wkv_b", "mlp.w1", "mlp.w3"}
    assert {n for n, role in plan.items() if role == "rowwise"} == {"attn.wo", "mlp.w2"}
    assert "attn.wq" in build(small()).tp_plan(build(small()).layers[0])
    routed = build(small(moe=ROUTED))
    with pytest.raises(ConfigError, match=r"^tensor parallelism does not support model family 'deepseek_v3' with routed "
                                          r"layers: .*set parallel.tp = 1"):
        routed.tp_plan(routed.layers[0])


def test_the_routed_layers_follow_first_dense_layers_with_deepseeks_routing():
    model = build(small(moe=ROUTED))
    assert type(model.layers[0].mlp).__name__ == "MLP" and type(model.layers[1].mlp).__name__ == "MoE"
    moe = model.layers[1].mlp.cfg
    assert (moe.scores, moe.norm_topk_prob, moe.routed_scaling_factor, moe.n_shared_experts, moe.selection_bias) == \
        ("sigmoid", True, 2.5, 1, True)  # the family's defaults beneath the keys given
    assert model.layers[1].mlp.router.expert_bias.shape == (8,)
    cfg = small(moe=ROUTED)
    # a token's matmuls: attention, the router, the shared expert and 2 of the 8 experts
    attention = cfg.layer_counts(0).matmul - 3 * 64 * 128
    assert cfg.layer_counts(1).matmul == attention + 8 * 64 + 3 * 64 * 16 + 2 * 3 * 64 * 16
    assert cfg.layer_counts(1).matrices == attention + 8 * 64 + 3 * 64 * 16 + 8 * 3 * 64 * 16


@pytest.mark.parametrize("moe, named", [
    (dict(scores="softmax"), "model.moe.scores = 'softmax' is not supported by family 'deepseek_v3'"),
    (dict(sparse_step=2), "model.moe.sparse_step = 2 is not supported by family 'deepseek_v3'"),
    (dict(n_experts_per_token=9), "model.moe.n_experts_per_token = 9 must be at most model.moe.n_experts = 8"),
])
def test_a_routing_deepseek_v3_does_not_compute_is_refused_in_one_line(moe, named):
    with pytest.raises(ValueError) as info:
        small(moe=moe)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_the_deepseek_v3_preset_has_its_671b_parameters_and_37b_active():
    cfg = DeepseekV3Config.from_preset("deepseek-v3")
    counts = cfg.param_counts()
    assert round(counts.total() / 1e9) == 671  # the technical report's 671B (its MTP module's 14B apart)
    active = sum(layer.matmul for layer in counts.layers) + counts.embedding + counts.head_matmul
    assert round(active / 1e9) == 38  # 37.55B: the report's "37B activated for each token"
    assert cfg.sparse_layers() == (False,) * 3 + (True,) * 58


# --------------------------------------------------------------------------- config.json keys

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=16, n_group=2,
            topk_group=1, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=None, eos_token_id=None)
# key -> (what else the pair of configs sets, the value away from the default)
VARIANTS: dict[str, tuple[dict, object]] = {
    "vocab_size": ({}, 301),
    "hidden_size": ({}, 96),
    "intermediate_size": ({}, 96),
    "num_hidden_layers": ({}, 3),
    "num_attention_heads": ({"num_key_value_heads": 8}, 8),
    "num_key_value_heads": ({}, 2),
    "q_lora_rank": ({}, 24),
    "kv_lora_rank": ({}, 16),
    "qk_nope_head_dim": ({}, 8),
    "qk_rope_head_dim": ({}, 16),
    "v_head_dim": ({}, 16),
    "rope_interleave": ({}, False),
    "head_dim": ({}, 16),
    "rms_norm_eps": ({}, 0.5),
    "tie_word_embeddings": ({}, True),
    "max_position_embeddings": ({}, 128),
    "hidden_act": ({}, "gelu"),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    # transformers < 5's spelling; YaRN with DeepSeek's mscale pair, which also scales the scores
    "rope_scaling": ({}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                          "mscale_all_dim": 0.5}),
    "rope_theta": ({}, 300.0),
    "attention_bias": ({"q_lora_rank": 24}, True),
    "attention_dropout": ({}, 0.1),
    "first_k_dense_replace": ({}, 2),
    "moe_intermediate_size": ({}, 8),
    "n_shared_experts": ({}, 2),
    "n_routed_experts": ({}, 4),
    "routed_scaling_factor": ({}, 1.0),
    "n_group": ({}, 4),
    "topk_group": ({}, 2),
    "num_experts_per_tok": ({}, 3),
    "norm_topk_prob": ({}, False),
    "quantization_config": ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    "pruned_heads": ({}, {"0": [1]}),
    "auto_map": ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
}
NOT_ON_EVAL_LOGITS = {  # keys whose change a tiny model cannot show on its eval logits, and why
    "max_position_embeddings": "the context bound: no effect on a shorter input with plain RoPE; the import must keep it",
    "attention_dropout": "acts in training only: the test checks transformers' train-mode logits move",
    "head_dim": "transformers' RoPE of 16 pairs fails on the 8-wide rotated part",
    "num_key_value_heads": "transformers' eager attention repeats the 4 heads' keys into 8 and fails on the query's 4",
    "quantization_config": "building a quantized model needs a quantization backend; the weights are not plain matrices",
    "pruned_heads": "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    "auto_map": "custom modelling code (trust_remote_code) computes the model; the test builds none",
}


# tests/model/families/test_hf_config_keys.py holds every key against transformers by this; qk_head_dim and
# num_nextn_predict_layers are inert keys with samples of their own; num_local_experts, DeepseekV3Config's
# attribute_map name of n_routed_experts, is not classified: lmforge refuses it as a key it does not know
HF_KEYS = HfKeys(family="deepseek_v3", classes={"deepseek_v3": transformers.DeepseekV3Config}, base={"deepseek_v3": BASE},
                 variants=VARIANTS, not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=DeepseekV3,
                 inert_samples={**INERT_SAMPLES, "qk_head_dim": 40, "num_nextn_predict_layers": 2},
                 inert_must_check=frozenset({"qk_head_dim", "num_nextn_predict_layers"}),
                 unclassified_aliases=frozenset({"num_local_experts"}))


def make_config(**fields) -> transformers.DeepseekV3Config:
    return HF_KEYS.make_config("deepseek_v3", **fields)


def build_folder(path: Path, fields: dict, patch: dict) -> torch.nn.Module:
    return HF_KEYS.build_folder(path, "deepseek_v3", fields, patch)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale_all_dim": 1.0},
    {"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0},
], ids=["yarn-without-mscale", "linear"])
def test_mscale_all_dim_lmforge_cannot_scale_the_scores_by_is_refused(rope):
    config = {**make_config().to_dict(), "rope_parameters": {**rope, "rope_theta": 10000.0}}
    with pytest.raises(InputError, match=r"^x/config.json: rope_parameters = .* is not supported \(DeepSeek's attention "
                                         r"scales its scores by mscale_all_dim's mscale²"):
        model_config_from_hf(config, where="x/config.json")


# --------------------------------------------------------------------------- lmforge import / export


@pytest.mark.parametrize("fields", [
    dict(),
    dict(q_lora_rank=24, attention_bias=True, tie_word_embeddings=True, rope_interleave=False),
    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                          "mscale_all_dim": 0.707, "rope_theta": 1e4}),
    dict(n_shared_experts=0, first_k_dense_replace=0, norm_topk_prob=False),  # transformers' 0-wide shared experts
], ids=["plain", "q-lora-biases-tied-halves", "yarn-mscale", "every-layer-routed-no-shared-expert"])
def test_cli_import_then_export_round_trips_transformers_model_and_logits(tmp_path, fields):
    theirs = build_folder(tmp_path / "hf", fields, {})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    expected = logits(theirs)
    assert (logits(ours) - expected).abs().max().item() <= 1e-5

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["DeepseekV3ForCausalLM"]
    again = from_folder(tmp_path / "out")
    assert (logits(again) - expected).abs().max().item() <= 1e-5
    original, written = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)


def test_the_selection_bias_imports_and_exports_with_the_routing_it_changes(tmp_path):
    theirs = build_folder(tmp_path / "hf", {}, {})
    with torch.no_grad():
        theirs.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    theirs.save_pretrained(tmp_path / "hf")
    theirs = from_folder(tmp_path / "hf")
    unbiased = logits(theirs)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert torch.equal(ours.layers[1].mlp.router.expert_bias, torch.linspace(-0.5, 0.5, 8))
    assert (logits(ours) - unbiased).abs().max().item() <= 1e-5
    with torch.no_grad():
        ours.layers[1].mlp.router.expert_bias.zero_()
    assert (logits(ours) - unbiased).abs().max().item() > 1e-3  # the bias chooses other experts
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    bias = load_file(str(tmp_path / "out" / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, torch.linspace(-0.5, 0.5, 8))


@pytest.mark.parametrize("change, named", [
    (lambda w: w.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
     r"layer 1's experts \(model.layers.1.mlp.experts.\d+.up_proj.weight and the others\): expert 5 missing"),
    (lambda w: w.update({"model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(64, 8)}),
     r"model.layers.1.mlp.experts.2.down_proj.weight has shape \(64, 8\), unlike model.layers.1.mlp.experts.0"),
    (lambda w: w.update({f"model.layers.1.mlp.experts.{e}.gate_proj.weight": torch.zeros(8, 64) for e in range(8)}),
     r"weights do not match the model config: wrong shapes \['layers.1.mlp.experts.w1 \(8, 8, 64\)"),
], ids=["missing", "one-mis-shaped", "all-mis-shaped"])
def test_a_folder_whose_expert_tensors_are_missing_or_mis_shaped_is_one_line_naming_it_exit_2(tmp_path, capsys, change,
                                                                                              named):
    build_folder(tmp_path / "hf", {}, {})
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    change(weights)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    capsys.readouterr()  # transformers' progress bars
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(named, err) and f"{tmp_path / 'hf'}" in err and "\n" not in err, err
    assert not (tmp_path / "ckpt").exists()


def test_a_folder_whose_latent_projection_is_mis_shaped_is_one_line_naming_it(tmp_path):
    build_folder(tmp_path / "hf", {}, {"kv_lora_rank": 16})  # the weights are a 32-wide latent's
    with pytest.raises(InputError, match=r"hf: weights do not match the model config: wrong shapes .*kv_a_norm") as info:
        run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    assert "\n" not in str(info.value) and not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------- training, LoRA


def test_pretraining_a_deepseek_v3_with_its_balancing_lowers_the_loss_and_moves_the_bias(tmp_path, shards_dir,  # noqa: F811
                                                                                         small_tokenizer_dir):
    """Layer 1 routed (the family's default first_dense_layers = 1) with DeepSeek-V3's balancing: the
    aux-loss-free bias (γ = 1e-3) and the sequence-wise loss (α = 1e-4), through the one loop."""
    recipe = load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        tmp_path / "run", shards_dir, small_tokenizer_dir, **{
            "model.family": "deepseek_v3", "model.n_kv_heads": "null", "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
            "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
            "model.moe.expert_ffn_hidden": 16, "model.moe.bias_update_rate": 1e-3, "model.moe.seq_aux_loss_coef": 1e-4,
            "train.lr": 1e-2}))
    run_pretrain(recipe)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    assert all("moe/seq_balance" in r and "moe/layer1/entropy" in r for r in records)
    model, _ = load_model(tmp_path / "run")
    assert type(model) is DeepseekV3 and model.cfg.family == "deepseek_v3"
    bias = model.layers[1].mlp.router.expert_bias
    assert bias.abs().max() > 0 and torch.allclose(bias.abs(), torch.full_like(bias, 1e-3) * (bias.abs() / 1e-3).round())


@torch.no_grad()
def test_lora_on_the_latent_projections_merges_into_the_same_logits_and_names_transformers_modules():
    cfg = small(q_lora_rank=24)
    model = random_model(cfg)
    defaults = apply_lora(random_model(cfg), LoraConfig(r=4, alpha=8))
    assert len(defaults) == 4 * cfg.n_layers  # the output projection and the MLP's three: no wq, wk or wv here
    targets = ["attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo"]
    wrapped = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=targets))
    assert len(wrapped) == 5 * cfg.n_layers
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            p.normal_(0.0, 0.05)  # a trained adapter: B away from zero
    adapted = logits(model)
    assert (adapted - logits(random_model(cfg))).abs().max() > 1e-3
    tokens = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = model.new_kv_cache(1, 9, torch.float32, "cpu")  # a wrapped wkv_b decodes in the expanded form
    decoded = torch.cat([model(tokens[:, :5], kv_cache=cache)] + [model(tokens[:, i : i + 1], kv_cache=cache)
                                                                 for i in range(5, 9)], dim=1)
    torch.testing.assert_close(decoded, model(tokens), atol=1e-5, rtol=0)
    merge_lora(model)
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)),
                                                           attn_implementation="eager").eval()
    theirs.load_state_dict(state_dict_to_hf(model.state_dict(), cfg))
    torch.testing.assert_close(logits(theirs), adapted, atol=1e-5, rtol=0)
    assert to_hf_name("layers.1.attn.wkv_a.weight", "deepseek_v3") == "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


def test_a_saved_adapter_on_the_latent_projections_loads_in_peft_with_identical_logits(tmp_path):
    import peft

    from lmforge.checkpoints.files import write_checksums, write_model_files
    from lmforge.core.io import atomic_directory
    from lmforge.peft.adapters import save_adapter
    from tests.peft.test_lora import randomize_adapters_

    model = random_model(small(q_lora_rank=24, moe=ROUTED))  # a routed layer: its experts keep no adapter
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    lora_cfg = LoraConfig(r=4, alpha=8, target_modules=["attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo"])
    apply_lora(model, lora_cfg)
    randomize_adapters_(model)
    save_adapter(model, lora_cfg, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    theirs = peft.PeftModel.from_pretrained(from_folder(tmp_path / "hf"), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(theirs), logits(model), atol=1e-5, rtol=0)
