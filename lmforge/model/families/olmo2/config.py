"""OLMo 2's config: the shared fields, with those its blocks hold at one value refused at any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmforge.core.config import option
from lmforge.model.config import LayerCounts, ModelConfig

_FULL_ATTENTION = "Olmo2ForCausalLM attends to every position (for a sliding window use family llama's Mistral)"


@dataclass
class Olmo2Config(ModelConfig):
    """OLMo 2 (OLMo Team 2024, "2 OLMo 2 Furious"): RMSNorm after attention and after the MLP
    instead of before them, and QK-norm over the whole q and k projections; RoPE, SwiGLU, untied
    by default. The shared fields it computes at one value only are ``FIXED_FIELDS``."""

    family: str = option("olmo2", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")

    # shared fields OLMo 2's blocks compute at one value only: field -> (the value, why); another is refused
    FIXED_FIELDS: ClassVar[dict[str, tuple[Any, str]]] = {
        "norm": ("rmsnorm", "OLMo 2's norms are RMSNorm"),
        "ffn": ("swiglu", "OLMo 2's MLP is SwiGLU"),
        "positions": ("rope", "OLMo 2 rotates q and k (RoPE)"),
        "qk_norm": (False, "OLMo 2 always normalises the whole q and k projections; per-head QK-norm is Qwen3's "
                           "(family llama)"),
        "mlp_bias": (False, "OLMo 2's MLP has no biases"),
        "sliding_window": (None, _FULL_ATTENTION),
        "layer_types": (None, _FULL_ATTENTION),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, (value, why) in self.FIXED_FIELDS.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not supported by family {self.family!r}: {why}; "
                                 f"set it to {value!r}")
        if self.qkv_bias != self.out_bias:
            raise ValueError(f"qkv_bias = {self.qkv_bias} with out_bias = {self.out_bias} is not supported by family "
                             f"{self.family!r}: OLMo 2's attention_bias puts biases on q, k, v and the output projection "
                             "together; set both alike")

    def layer_counts(self, layer: int) -> LayerCounts:
        """The shared block's projections and two norms of ``d_model`` (after the branches, not before
        them), and the QK-norms over the whole q (n_heads·head_dim) and k (n_kv_heads·head_dim) projections."""
        shared = super().layer_counts(layer)
        qk_norms = (self.n_heads + self.n_kv_heads) * self.head_dim
        return LayerCounts(matrices=shared.matrices, norms=shared.norms + qk_norms, matmul=shared.matmul)
