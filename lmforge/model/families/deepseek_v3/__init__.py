"""The DeepSeek-V3 family: pre-norm RMSNorm blocks of multi-head latent attention (``model.mla``: keys
and values compressed into a latent per token, a decoupled RoPE key shared by the heads, YaRN's mscale
on the scores) and a SwiGLU MLP on the first layers, DeepSeek's routed FFN (``model.moe``: sigmoid
scores, group-limited top-k, shared experts, the aux-loss-free selection bias) on the others. Cached decoding keeps only each token's latent and RoPE key and
attends in the absorbed form. The decoding layout of ``model.fused`` does not apply (it joins q/k/v
projections MLA does not have); tensor parallelism splits the heads of a dense model and refuses
routed layers (``DeepseekV3.tp_plan``)."""

from lmforge.model.families.deepseek_v3 import hf
from lmforge.model.families.deepseek_v3.config import DeepseekV3Config
from lmforge.model.families.deepseek_v3.model import DeepseekV3
from lmforge.model.family import Family, HFMapping

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: the llama family's "tiny" width with MLA's shape scaled from DeepSeek-V3's
    # (latent 4x the RoPE key, no-RoPE and value parts 2x it, compressed queries), one dense layer, then
    # 8 fine-grained experts (a quarter of the dense width) in 2 groups, 2 a token, and the shared one.
    "deepseek-v3-tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024,
                             q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                             moe=dict(n_experts=8, n_experts_per_token=2, expert_ffn_hidden=256, n_group=2,
                                      topk_group=1, first_dense_layers=1)),
    # deepseek-ai/DeepSeek-V3's shape (without its multi-token prediction module): 61 layers of width 7168,
    # 128 heads, q/kv latents of 1536/512, the first 3 layers dense (18432), then 256 experts of 2048 in 8
    # groups, 8 a token from the best 4 groups, one shared; YaRN 40x from 4096 with mscale 1/1.
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, ffn_hidden=18432, max_seq_len=163840,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_scaling="yarn", rope_factor=40.0, rope_original_max_seq_len=4096, rope_mscale=1.0,
                        rope_mscale_all_dim=1.0,
                        moe=dict(n_experts=256, n_experts_per_token=8, expert_ffn_hidden=2048, n_group=8, topk_group=4,
                                 first_dense_layers=3)),
}

FAMILY = Family(
    name="deepseek_v3",
    summary="DeepSeek-V3: multi-head latent attention (compressed kv and q, decoupled RoPE key, latent cache), "
    "dense then routed SwiGLU layers (sigmoid, grouped top-k, shared experts, selection bias)",
    config=DeepseekV3Config,
    model=DeepseekV3,
    presets=PRESETS,
    decoding_layout=False,
    hf=HFMapping.from_module(hf),
)
