"""Every family trains under torchrun as in one process: FSDP2 for each, tensor parallelism (with
and without sequence parallelism) where the family's ``tp_plan`` allows it. GPT-2's runs are in
tests/model/families/test_gpt2.py; OLMo 2 refuses tensor parallelism (test_olmo2.py).

The reference and the two-rank runs compute the same sums in other orders (gloo's all-reduce,
the row-wise projections' partial sums), so the losses and gradient norms of the first steps
agree to float32 rounding accumulated over a few steps: rel 1e-5."""

from __future__ import annotations

import pytest

from lmforge.core.config import load_config
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

# name -> the family's model keys over the tiny recipe's (2 layers, width 32, 4 heads, 2 KV heads, vocabulary 512)
FAMILIES = {
    # Gemma 2's local/global pattern, soft-capped scores and logits, its tied head
    "gemma": {"model.preset": "gemma2-tiny", "model.d_model": 32, "model.n_layers": 2, "model.head_dim": 8,
              "model.ffn_hidden": 64, "model.max_seq_len": 64, "model.sliding_window": 8,
              "model.layer_types": "[sliding_attention,full_attention]", "model.n_kv_heads": 2},
    # Gemma 3's QK-norm on each rank's heads and its local RoPE base on the sliding layer
    "gemma3": {"model.preset": "gemma3-tiny", "model.d_model": 32, "model.n_layers": 2, "model.head_dim": 8,
               "model.ffn_hidden": 64, "model.max_seq_len": 64, "model.sliding_window": 8,
               "model.layer_types": "[sliding_attention,full_attention]", "model.n_kv_heads": 2},
    "olmo2": {"model.family": "olmo2"},
    "phi3": {"model.family": "phi3", "model.sliding_window": 16},
    # multi-head latent attention: the compressing projections replicated, whole heads of q and the latent's
    # up-projection on each rank (every layer dense: TP refuses routed layers); then with DeepSeek's routed layer
    "deepseek_v3": {"model.family": "deepseek_v3", "model.n_kv_heads": "null", "model.q_lora_rank": 16,
                    "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8,
                    "model.v_head_dim": 8, "model.moe.first_dense_layers": 2},
    "deepseek_v3_moe": {"model.family": "deepseek_v3", "model.n_kv_heads": "null", "model.kv_lora_rank": 16,
                        "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
                        "model.moe.expert_ffn_hidden": 16},
}
# name -> the parallel layouts it trains under (OLMo 2's whole-projection QK-norm refuses TP)
LAYOUTS = {
    "gemma": {"fsdp": {"parallel.dp_shard": 2}, "tp": {"parallel.tp": 2, "parallel.loss_parallel": False},
              "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.loss_parallel": False}},
    "gemma3": {"tp": {"parallel.tp": 2, "parallel.loss_parallel": False}},
    "olmo2": {"fsdp": {"parallel.dp_shard": 2}},
    "phi3": {"fsdp": {"parallel.dp_shard": 2}, "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True}},
    "deepseek_v3": {"fsdp": {"parallel.dp_shard": 2}, "tp": {"parallel.tp": 2, "parallel.loss_parallel": False},
                    "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True}},
    "deepseek_v3_moe": {"fsdp": {"parallel.dp_shard": 2}},
}


def test_each_family_trains_under_fsdp_and_tensor_parallelism_as_one_process(tmp_path, shards_dir,  # noqa: F811
                                                                             small_tokenizer_dir):
    def recipe(family: str, name: str, **overrides) -> PretrainRecipe:
        keys = {**FAMILIES[family], "train.max_steps": 3, "train.eval_every": 0, "train.checkpoint_every": 3, **overrides}
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(tmp_path / family / name, shards_dir,
                                                                         small_tokenizer_dir, **keys))

    def curve(family: str, name: str) -> list[float]:
        return [v for r in read_metrics(tmp_path / family / name) if "loss" in r for v in (r["loss"], r["grad_norm"])]

    jobs = []
    for family, layouts in LAYOUTS.items():
        run_pretrain(recipe(family, "reference"))
        jobs += [{"kind": "pretrain", "recipe": recipe(family, name, **keys)} for name, keys in layouts.items()]
    torchrun(2, jobs, tmp_path)
    for family, layouts in LAYOUTS.items():
        expected = curve(family, "reference")
        assert len(expected) == 6, family
        for name in layouts:
            assert curve(family, name) == pytest.approx(expected, rel=1e-5), (family, name)
