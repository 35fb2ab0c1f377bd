"""Phi-3's config: the shared fields, with those Phi3ForCausalLM holds at one value refused at any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmforge.core.config import option
from lmforge.model.config import ModelConfig

_PLAIN_OR_LONGROPE = "Phi3ForCausalLM's RoPE is plain or longrope, which do not read it"


@dataclass
class Phi3Config(ModelConfig):
    """Phi-3 (Abdin et al. 2024): the Llama arithmetic (pre-norm RMSNorm blocks, RoPE, GQA, SwiGLU, no
    biases), with plain RoPE or LongRoPE and an optional sliding window on every layer; in Hugging Face's
    layout q/k/v and the MLP's gate/up projections are joined (``hf.py``). The shared fields it computes
    at one value only are ``FIXED_FIELDS``; ``rope_scaling`` is ``none`` or ``longrope``."""

    family: str = option("phi3", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")

    # shared fields Phi-3's blocks compute at one value only: field -> (the value, why); another is refused
    FIXED_FIELDS: ClassVar[dict[str, tuple[Any, str]]] = {
        "norm": ("rmsnorm", "Phi-3's norms are RMSNorm"),
        "ffn": ("swiglu", "Phi-3's MLP is SwiGLU"),
        "positions": ("rope", "Phi-3 rotates q and k (RoPE)"),
        "qk_norm": (False, "Phi-3 has no QK-norm"),
        **dict.fromkeys(("qkv_bias", "out_bias", "mlp_bias"), (False, "Phi-3's projections have no biases")),
        "layer_types": (None, "Phi-3's sliding_window, when set, is on every layer"),
        **{name: (ModelConfig.__dataclass_fields__[name].default, _PLAIN_OR_LONGROPE) for name in (
            "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
            "rope_mscale_all_dim", "rope_truncate")},
    }
    ROPE_SCALINGS: ClassVar[tuple[str, ...]] = ("none", "longrope")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_scaling not in self.ROPE_SCALINGS:
            raise ValueError(f"rope_scaling = {self.rope_scaling!r} is not supported by family {self.family!r}: "
                             "Phi3ForCausalLM computes plain RoPE or longrope; set it to 'none' or 'longrope'")
        for name, (value, why) in self.FIXED_FIELDS.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not supported by family {self.family!r}: {why}; "
                                 f"set it to {value!r}")
