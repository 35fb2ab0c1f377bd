"""The OLMo 2 family: blocks of the shared parts with their norms after attention and the MLP (the
reordered residual) and QK-norm over the whole q and k projections; RoPE, MHA/GQA, SwiGLU. Tensor
parallelism is refused (``Olmo2.tp_plan``); the decoding layout applies (``Olmo2Attention``)."""

from lmforge.model.families.olmo2 import hf
from lmforge.model.families.olmo2.config import Olmo2Config
from lmforge.model.families.olmo2.model import Olmo2
from lmforge.model.family import Family, HFMapping

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: the llama family's "tiny" shape with OLMo 2's blocks, eps and theta.
    "olmo2-tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024,
                       norm_eps=1e-6, rope_theta=500000.0),
    # allenai/OLMo-2-0425-1B's shape: 16 layers of width 2048, 16 heads, SwiGLU 8192, theta 5e5, untied.
    "olmo2-1b": dict(vocab_size=100352, d_model=2048, n_layers=16, n_heads=16, ffn_hidden=8192, max_seq_len=4096,
                     norm_eps=1e-6, rope_theta=500000.0),
    # allenai/OLMo-2-1124-7B's shape: 32 layers of width 4096, 32 heads, SwiGLU 11008, theta 5e5, untied.
    "olmo2-7b": dict(vocab_size=100352, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008, max_seq_len=4096,
                     norm_eps=1e-6, rope_theta=500000.0),
}

FAMILY = Family(
    name="olmo2",
    summary="OLMo 2: norms after attention and the MLP, QK-norm over the whole projections; RoPE, SwiGLU",
    config=Olmo2Config,
    model=Olmo2,
    presets=PRESETS,
    hf=HFMapping.from_module(hf),
)
