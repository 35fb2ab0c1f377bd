"""The transformer's shape, its presets, and the arithmetic users ask of it (params, FLOPs)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from lmforge.core.config import at_least, check_ranges, positive


@dataclass
class ModelConfig:
    """A decoder-only transformer.

    In a recipe, ``preset: <name>`` fills the fields the preset names and keys written
    beside it win; in Python use ``ModelConfig.from_preset(name, **overrides)``.
    """

    preset: str | None = None  # tiny | gpt2-124m | smollm2-135m | llama3-1b (see PRESETS)
    vocab_size: int = positive(8192)
    d_model: int = positive(384)
    n_layers: int = positive(6)
    n_heads: int = positive(6)
    n_kv_heads: int | None = positive(None)  # None = n_heads (MHA); 1 = MQA; in between = GQA
    head_dim: int | None = positive(None)  # None = d_model // n_heads
    ffn: Literal["swiglu", "gelu"] = "swiglu"
    ffn_hidden: int | None = positive(None)  # None = 8/3 d_model rounded up to 64 (SwiGLU) or 4 d_model (GELU)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = positive(1e-5)
    rope_theta: float = positive(10000.0)
    rope_scaling: Literal["none", "llama3"] = "none"  # llama3: Llama 3.1's RoPE scaling, set by the four keys below
    rope_factor: float = at_least(1, 1.0)  # long wavelengths are stretched by this factor (Llama 3.1/3.2: 8 or 32)
    rope_low_freq_factor: float = positive(1.0)  # wavelengths above rope_original_max_seq_len / this are fully stretched
    rope_high_freq_factor: float = positive(4.0)  # wavelengths below rope_original_max_seq_len / this are kept
    rope_original_max_seq_len: int | None = positive(None)  # the context the model was pretrained at (Llama 3: 8192)
    max_seq_len: int = positive(2048)
    tie_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2 has them)
    out_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    init_std: float = positive(0.02)

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        check_ranges(self, source="model")  # built in Python too: a zero or negative size fails here
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model = {self.d_model} must be divisible by n_heads = {self.n_heads} "
                                 "(or set head_dim)")
            self.head_dim = self.d_model // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads = {self.n_heads} must be a multiple of n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim} must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.d_model if self.ffn == "gelu" else 64 * -(-(8 * self.d_model // 3) // 64)
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        params = {
            "rope_factor": self.rope_factor,
            "rope_low_freq_factor": self.rope_low_freq_factor,
            "rope_high_freq_factor": self.rope_high_freq_factor,
            "rope_original_max_seq_len": self.rope_original_max_seq_len,
        }
        if self.rope_scaling == "none":
            defaults = {f.name: f.default for f in fields(self) if f.name in params}
            changed = [f"{k}={v}" for k, v in params.items() if v != defaults[k]]
            if changed:
                raise ValueError(f"{', '.join(changed)} set but rope_scaling is 'none'; set rope_scaling: llama3 or remove them")
            return
        if self.rope_scaling != "llama3":
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not supported; choose 'none' or 'llama3'")
        if self.rope_original_max_seq_len is None or self.rope_original_max_seq_len <= 0:
            raise ValueError(
                f"rope_scaling llama3 needs rope_original_max_seq_len, the pretraining context "
                f"(a positive integer, 8192 for Llama 3.1/3.2), got {self.rope_original_max_seq_len}"
            )
        if not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor = {self.rope_low_freq_factor} must be below rope_high_freq_factor = "
                f"{self.rope_high_freq_factor} (Llama 3.1/3.2: 1 and 4)"
            )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], "preset": name, **overrides})

    @classmethod
    def expand_preset(cls, data: dict) -> dict:
        """Recipe hook (see ``core.config.from_dict``): the preset's fields under the user's keys."""
        name = data.get("preset")
        if name is None:
            return data
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return {**PRESETS[name], **data}

    # -- arithmetic
    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count; the (possibly tied) output matrix is counted once."""
        d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_hidden
        norm = d * (2 if self.norm == "layernorm" else 1)
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        attn += (h * hd + 2 * kv * hd) * self.qkv_bias + d * self.out_bias + 2 * hd * self.qk_norm
        n_mats = 3 if self.ffn == "swiglu" else 2
        mlp = n_mats * d * f + ((n_mats - 1) * f + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * norm
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total = self.n_layers * per_layer + norm + head + (embed if include_embedding else 0)
        return total

    def matmul_params(self) -> int:
        """Weights that take part in matmuls: every projection plus the output head (not norms, biases, lookups)."""
        d, h, kv, hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        attn = 2 * d * h * hd + 2 * d * kv * hd
        mlp = (3 if self.ffn == "swiglu" else 2) * d * self.ffn_hidden
        return self.n_layers * (attn + mlp) + self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·H·Dh·T for attention (PaLM, App. B)."""
        return 6 * self.matmul_params() + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: ~17M parameters, the shape of the CPU benchmarks.
    "tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024),
    # GPT-2 small's shape (LayerNorm, GELU MLP, biases, tied), with RoPE in place of learned positions.
    "gpt2-124m": dict(
        vocab_size=50257, d_model=768, n_layers=12, n_heads=12, ffn="gelu", ffn_hidden=3072, norm="layernorm",
        tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True, max_seq_len=1024,
    ),
    # HuggingFaceTB/SmolLM2-135M's shape: GQA 9/3, SwiGLU 1536, tied, theta 1e5.
    "smollm2-135m": dict(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden=1536,
        rope_theta=100000.0, tie_embeddings=True, max_seq_len=2048,
    ),
    # Llama-3.2-1B's shape: GQA 32/8, SwiGLU 8192, tied, theta 5e5.
    "llama3-1b": dict(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
        rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192,
    ),
}
