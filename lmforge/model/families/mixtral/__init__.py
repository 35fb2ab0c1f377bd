"""The mixture-of-experts family: Mixtral and Qwen3-MoE, the shared pre-norm blocks (RoPE, GQA, optional
QK-norm and window) with the routed FFN of ``model.moe`` on their sparse layers. Tensor parallelism is
refused (``Mixtral.tp_plan``); the decoding layout joins attention's projections and leaves the experts."""

from lmforge.model.families.mixtral import hf
from lmforge.model.families.mixtral.config import MixtralConfig
from lmforge.model.families.mixtral.model import Mixtral
from lmforge.model.family import Family, HFMapping

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: 4 layers of width 256, 8 experts of 512 of which 2 per token (active ~ a dense
    # FFN of 1024), GQA 4/2.
    "mixtral-tiny": dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                         max_seq_len=1024, norm_eps=1e-5, rope_theta=1e6,
                         moe={"n_experts": 8, "n_experts_per_token": 2}),
    # mistralai/Mixtral-8x7B-v0.1's shape: 32 layers of width 4096, 32 heads over 8 kv heads, 8 experts of
    # 14336, 2 per token, theta 1e6.
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                         max_seq_len=32768, norm_eps=1e-5, rope_theta=1e6, moe={"n_experts": 8, "n_experts_per_token": 2}),
    # Qwen/Qwen3-30B-A3B's shape: 48 layers of width 2048, 32 heads of 128 over 4 kv heads, QK-norm, 128
    # experts of 768, 8 per token with normalised weights.
    "qwen3-moe-30b-a3b": dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                              ffn_hidden=6144, max_seq_len=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                              moe={"n_experts": 128, "n_experts_per_token": 8, "expert_ffn_hidden": 768,
                                   "norm_topk_prob": True}),
}

FAMILY = Family(
    name="mixtral",
    summary="mixture of experts (Mixtral, Qwen3-MoE): routed top-k SwiGLU experts in the MLP's place; RoPE, GQA",
    config=MixtralConfig,
    model=Mixtral,
    presets=PRESETS,
    hf=HFMapping.from_module(hf),
)
