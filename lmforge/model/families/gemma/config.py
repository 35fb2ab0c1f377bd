"""The Gemma family's config: ``ModelConfig``'s fields, less the shared parts Gemma fixes, plus its own.

Gemma 2 and Gemma 3 differ by these fields only (``hf.py`` picks the class): both softcaps and
every-other-layer windows are Gemma 2's, QK-norm and a local RoPE base Gemma 3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmforge.core.config import option, positive
from lmforge.model.config import LayerCounts, ModelConfig


@dataclass
class GemmaConfig(ModelConfig):
    """A Gemma 2 or Gemma 3 text model (Gemma Team 2024, 2025)."""

    # The shared parts Gemma fixes are class constants, not fields: a recipe that sets one is told
    # the key is unknown, and the parity test's field coverage does not ask for a variant of it.
    ffn: ClassVar[str] = "geglu"  # w2(gelu_tanh(w1 x) * w3 x), model.GeGLU
    norm: ClassVar[str] = "rmsnorm"  # x / rms(x) * (1 + w), in float32 (model.GemmaRMSNorm)
    positions: ClassVar[str] = "rope"
    mlp_bias: ClassVar[bool] = False

    family: str = option("gemma", help="the model family (lmforge.model.families): its blocks, counts, HF mapping")
    norm_eps: float = positive(1e-6, help="the epsilon added to the mean square in every norm")
    tie_embeddings: bool = option(True, help="the output head shares the token embedding's weights (every Gemma does)")
    qk_norm: bool = option(False, help="Gemma 3: (1 + w) RMSNorm on each head's queries and keys before RoPE")
    qkv_bias: bool = option(False, help="biases on q, k, v and the output projection (Gemma's attention_bias: "
                            "set out_bias alike)")
    attn_softcap: float | None = positive(
        None, help="Gemma 2: each attention score s becomes c·tanh(s / c) (50); None = not capped"
    )
    final_softcap: float | None = positive(
        None, help="Gemma 2: each logit z becomes c·tanh(z / c) (30); None = not capped"
    )
    query_pre_attn_scalar: int | None = positive(
        None, help="attention scores are scaled by this ** -0.5 (Gemma 2 27B: 144); None = head_dim"
    )
    rope_local_theta: float | None = positive(
        None,
        help="Gemma 3: the sliding layers' RoPE base (10000), plain RoPE without rope_scaling; "
        "None = they rotate as the full layers do",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qkv_bias != self.out_bias:
            raise ValueError(f"qkv_bias = {self.qkv_bias} and out_bias = {self.out_bias}: Gemma's attention_bias puts "
                             "biases on q, k, v and the output projection together; set both alike")
        if self.rope_local_theta is not None and not any(self.sliding_layers()):
            raise ValueError(f"rope_local_theta = {self.rope_local_theta} is set but no layer slides: set sliding_window "
                             "(and layer_types) or remove rope_local_theta")

    def layer_counts(self, layer: int) -> LayerCounts:
        """A Gemma block: q/k/v/o, the GeGLU's three matrices, four norms of the width (two before and
        two after its branches) and, with QK-norm, two of the head."""
        d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_hidden
        weights = 2 * d * h * hd + 2 * d * kv * hd + 3 * d * f
        biases = (h * hd + 2 * kv * hd + d) * self.qkv_bias
        return LayerCounts(matrices=weights + biases, norms=4 * d + 2 * hd * self.qk_norm, matmul=weights)
