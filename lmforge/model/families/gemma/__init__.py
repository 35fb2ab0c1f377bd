"""The Gemma family: Gemma 2 and Gemma 3 (text), blocks normalised before and after each branch,
(1 + w) RMSNorm, GeGLU, an embedding scaled by √d, soft-capped attention scores and logits
(Gemma 2), QK-norm and a local RoPE base for the sliding layers (Gemma 3), local/global layers.

The decoding layout (``model.fused``) does not apply: it rebuilds each QK-norm as ``nn.RMSNorm``
over permuted gains, which would drop Gemma 3's (1 + w) and its float32 arithmetic; cached
decoding runs the model's own modules."""

from lmforge.model.families.gemma import hf
from lmforge.model.families.gemma.config import GemmaConfig
from lmforge.model.families.gemma.model import Gemma
from lmforge.model.family import Family, HFMapping


def layer_types(n_layers: int, every: int) -> list[str]:
    """Every ``every``-th layer full, the others sliding (Gemma 2: every 2nd; Gemma 3: every 6th)."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]


PRESETS: dict[str, dict] = {
    # Fit the 2-core CPU (4M and 8M parameters besides the embedding), each with its generation's layer pattern.
    "gemma2-tiny": dict(
        vocab_size=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_hidden=1024,
        max_seq_len=1024, sliding_window=256, layer_types=layer_types(4, 2), attn_softcap=50.0, final_softcap=30.0,
    ),
    "gemma3-tiny": dict(
        vocab_size=8192, d_model=256, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=64, ffn_hidden=1536,
        max_seq_len=1024, sliding_window=128, layer_types=layer_types(6, 6), qk_norm=True,
        rope_theta=1_000_000.0, rope_local_theta=10_000.0,
    ),
    # google/gemma-2-2b's config.json: GQA 8/4 of head 256, GeGLU 9216, window 4096 on every other layer,
    # scores capped at 50 and logits at 30, query_pre_attn_scalar 256 (= head_dim).
    "gemma2-2b": dict(
        vocab_size=256000, d_model=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256, ffn_hidden=9216,
        max_seq_len=8192, sliding_window=4096, layer_types=layer_types(26, 2), attn_softcap=50.0, final_softcap=30.0,
    ),
    # google/gemma-3-1b-pt's config.json: MQA 4/1 of head 256, GeGLU 6912, window 512 on five layers in six,
    # QK-norm, RoPE base 1e6 on the full layers and 1e4 on the sliding ones, no soft-capping.
    "gemma3-1b": dict(
        vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_hidden=6912,
        max_seq_len=32768, sliding_window=512, layer_types=layer_types(26, 6), qk_norm=True,
        rope_theta=1_000_000.0, rope_local_theta=10_000.0,
    ),
}

FAMILY = Family(
    name="gemma",
    summary="Gemma 2 (soft-capped scores and logits), Gemma 3 text (QK-norm, local RoPE base); pre- and post-norms, "
    "(1 + w) RMSNorm, GeGLU, √d embedding, local/global sliding windows",
    config=GemmaConfig,
    model=Gemma,
    presets=PRESETS,
    decoding_layout=False,
    hf=HFMapping.from_module(hf),
)
