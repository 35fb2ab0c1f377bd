"""The DeepSeek-V3 family: pre-norm RMSNorm blocks of multi-head latent attention (``model.mla``: keys
and values compressed into a latent per token, a decoupled RoPE key shared by the heads, YaRN's mscale
on the scores) and a SwiGLU MLP. Cached decoding keeps only each token's latent and RoPE key and
attends in the absorbed form. The decoding layout of ``model.fused`` does not apply (it joins q/k/v
projections MLA does not have); tensor parallelism splits the heads (``DeepseekV3.tp_plan``)."""

from lmforge.model.families.deepseek_v3 import hf
from lmforge.model.families.deepseek_v3.config import DeepseekV3Config
from lmforge.model.families.deepseek_v3.model import DeepseekV3
from lmforge.model.family import Family, HFMapping

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: the llama family's "tiny" width with MLA's shape scaled from DeepSeek-V3's
    # (latent 4x the RoPE key, no-RoPE and value parts 2x it, compressed queries) and every layer dense.
    "deepseek-v3-tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024,
                             q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
}

FAMILY = Family(
    name="deepseek_v3",
    summary="DeepSeek-V3: multi-head latent attention (compressed kv and q, decoupled RoPE key, latent cache), "
    "SwiGLU; dense layers",
    config=DeepseekV3Config,
    model=DeepseekV3,
    presets=PRESETS,
    decoding_layout=False,
    hf=HFMapping.from_module(hf),
)
