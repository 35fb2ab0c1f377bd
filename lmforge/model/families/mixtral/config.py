"""The mixture-of-experts family's config: the shared fields and the routed FFN's section ``moe``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmforge.core.config import option
from lmforge.model.config import LayerCounts, ModelConfig
from lmforge.model.moe import MoEConfig, moe_config


@dataclass
class MixtralConfig(ModelConfig):
    """Mixtral (Jiang et al. 2024) and Qwen3-MoE: the shared pre-norm blocks with a routed FFN
    (``model.moe``, ``lmforge.model.moe.MoEConfig``) in the MLP's place on the layers
    ``moe.sparse_layers`` names, the dense SwiGLU of ``ffn_hidden`` on the others. Qwen3-MoE is
    this with ``qk_norm``. The shared fields its blocks compute at one value only are ``FIXED_FIELDS``."""

    family: str = option("mixtral", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")
    moe: MoEConfig = option(default_factory=MoEConfig, help="the routed FFN: experts, top-k, routing and balancing "
                            "(model.moe.n_experts, ...)")

    FIXED_FIELDS: ClassVar[dict[str, tuple[Any, str]]] = {
        "norm": ("rmsnorm", "Mixtral's and Qwen3-MoE's norms are RMSNorm"),
        "ffn": ("swiglu", "the experts and dense layers are SwiGLU"),
        "positions": ("rope", "Mixtral and Qwen3-MoE rotate q and k (RoPE)"),
        "mlp_bias": (False, "the experts have no biases"),
        "layer_types": (None, "Mixtral and Qwen3-MoE window every layer or none (sliding_window)"),
    }

    def __post_init__(self) -> None:
        self.moe = moe_config(self.moe)  # read back from a checkpoint's model_config.json: a dict
        super().__post_init__()
        for name, (value, why) in self.FIXED_FIELDS.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not supported by family {self.family!r}: {why}; "
                                 f"set it to {value!r}")
        bad = [i for i in self.moe.dense_layers or () if i >= self.n_layers]
        if bad:
            raise ValueError(f"model.moe.dense_layers names layer {bad[0]}, past the model's n_layers = {self.n_layers}")

    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its FFN is the routed one."""
        return self.moe.sparse_layers(self.n_layers)

    def expert_width(self) -> int:
        return self.moe.width(self.ffn_hidden)

    def ffn_activation_bytes(self, compute_bytes: int) -> float:
        """The mean over layers of what autograd keeps per token for the FFN: a dense layer's SwiGLU, a sparse
        one's routed FFN (``MoEConfig.ffn_activation_bytes``)."""
        return self.moe.mean_ffn_activation_bytes(self.n_layers, self.d_model, self.ffn_hidden,
                                                  super().ffn_activation_bytes(compute_bytes), compute_bytes)

    def layer_counts(self, layer: int) -> LayerCounts:
        """A dense layer is the shared block's; a sparse one has the router (E·d), every expert's three
        matrices (3·E·d·f) and the shared experts' (3·d·n_shared·f) in place of the MLP, of which a
        token's matmuls use the router, its k experts and the shared experts (``matmul``: active weights)."""
        shared = super().layer_counts(layer)
        if not self.sparse_layers()[layer]:
            return shared
        attention = shared.matmul - 3 * self.d_model * self.ffn_hidden
        routed, active = self.moe.ffn_weights(self.d_model, self.ffn_hidden)
        biases = shared.matrices - shared.matmul  # attention's (the MLP has none)
        return LayerCounts(matrices=attention + routed + biases, norms=shared.norms, matmul=attention + active)
