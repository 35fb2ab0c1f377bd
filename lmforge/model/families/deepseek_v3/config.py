"""DeepSeek-V3's config: the shared fields, multi-head latent attention's own (transformers'
``DeepseekV3Config`` names), and the shared fields its blocks hold at one value refused at any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmforge.core.config import option, positive
from lmforge.model.config import LayerCounts, ModelConfig
from lmforge.model.moe import MoEConfig

# DeepSeek-V3's routing (sigmoid scores, normalised top-k times 2.5, one shared expert, the selection bias
# transformers calls e_score_correction_bias) over 8 experts after one dense layer: the family's model.moe
DEEPSEEK_MOE = dict(n_experts=8, n_experts_per_token=2, scores="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                    n_shared_experts=1, selection_bias=True, first_dense_layers=1)


def deepseek_moe(value: MoEConfig | dict | None = None) -> MoEConfig:
    """The family's ``moe`` section: ``DEEPSEEK_MOE`` under the keys a mapping gives (a recipe's, a
    checkpoint's model_config.json)."""
    if isinstance(value, MoEConfig):
        return value
    return MoEConfig(**{**DEEPSEEK_MOE, **(value or {})})

_FULL_ATTENTION = "DeepseekV3ForCausalLM attends to every position"


@dataclass
class DeepseekV3Config(ModelConfig):
    """DeepSeek-V3 (DeepSeek-AI 2024): pre-norm RMSNorm blocks whose attention is multi-head latent
    attention (``model.mla``: keys and values compressed into ``kv_lora_rank`` per token, queries
    optionally into ``q_lora_rank``, a decoupled RoPE key of ``qk_rope_head_dim`` shared by the
    heads) and whose FFN is a SwiGLU MLP on the first ``moe.first_dense_layers`` layers and the routed
    FFN of ``lmforge.model.moe`` (sigmoid scores, group-limited routing, shared experts, the selection
    bias) on the others. ``head_dim`` is the RoPE part of a head (``qk_rope_head_dim``,
    as transformers sets it) and every head has its own keys and values (``n_kv_heads = n_heads``).
    The shared fields it computes at one value only are ``FIXED_FIELDS``."""

    family: str = option("deepseek_v3", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")
    norm_eps: float = positive(1e-6, help="the epsilon added to the variance in the blocks' and the final norm "
                               "(the compressed q's and kv's norms use 1e-6, as DeepSeek's)")
    q_lora_rank: int | None = positive(None, help="width of the compressed query (DeepSeek-V3: 1536); "
                                       "None = one query projection from d_model (DeepSeek-V2-Lite)")
    kv_lora_rank: int | None = positive(None, help="width of the latent that keys and values are compressed into "
                                        "(DeepSeek-V3: 512); what the cache holds per token and layer, with the RoPE "
                                        "key; None = d_model / 4 (DeepSeek-V2-Lite's ratio)")
    qk_nope_head_dim: int = positive(32, help="each head's query/key width without RoPE, read from the latent "
                                     "(DeepSeek-V3: 128)")
    qk_rope_head_dim: int = positive(16, help="the decoupled RoPE key's width, one for every head, and each query "
                                     "head's rotated part (DeepSeek-V3: 64)")
    v_head_dim: int = positive(32, help="each head's value width (DeepSeek-V3: 128)")
    rope_interleave: bool = option(True, help="RoPE rotates interleaved pairs (x0, x1), (x2, x3)... of the rotated "
                                   "part, as DeepSeek's weights expect; false = the halves (x_i, x_(i+d/2)), as Llama")
    moe: MoEConfig = option(default_factory=deepseek_moe, help="the routed FFN of the layers from "
                            "moe.first_dense_layers on (first_k_dense_replace; n_layers or more: every layer dense): "
                            "experts, top-k, routing and balancing (model.moe.n_experts, ...)")

    # shared fields DeepSeek-V3's blocks compute at one value only: field -> (the value, why); another is refused
    FIXED_FIELDS: ClassVar[dict[str, tuple[Any, str]]] = {
        "norm": ("rmsnorm", "DeepSeek-V3's norms are RMSNorm"),
        "ffn": ("swiglu", "DeepSeek-V3's MLP is SwiGLU"),
        "positions": ("rope", "DeepSeek-V3 rotates the decoupled RoPE part of q and k"),
        "qk_norm": (False, "multi-head latent attention normalises the compressed q and kv instead"),
        "mlp_bias": (False, "DeepSeek-V3's MLP has no biases"),
        "sliding_window": (None, _FULL_ATTENTION),
        "layer_types": (None, _FULL_ATTENTION),
    }

    def __post_init__(self) -> None:
        self.moe = deepseek_moe(self.moe)
        if self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim
        super().__post_init__()
        if self.kv_lora_rank is None:
            self.kv_lora_rank = max(1, self.d_model // 4)
        for name, (value, why) in self.FIXED_FIELDS.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not supported by family {self.family!r}: {why}; "
                                 f"set it to {value!r}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"head_dim = {self.head_dim} is not supported by family {self.family!r}: it is the RoPE part "
                             f"of a head, qk_rope_head_dim = {self.qk_rope_head_dim}; leave head_dim unset")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads = {self.n_kv_heads} is not supported by family {self.family!r}: multi-head latent "
                             f"attention gives each of the n_heads = {self.n_heads} heads its own keys and values; leave "
                             "n_kv_heads unset")
        if self.qkv_bias != self.out_bias:
            raise ValueError(f"qkv_bias = {self.qkv_bias} with out_bias = {self.out_bias} is not supported by family "
                             f"{self.family!r}: DeepSeek's attention_bias puts biases on the compressing projections and "
                             "the output projection together; set both alike")
        for key in ("kv_lora_rank", "q_lora_rank"):
            rank = getattr(self, key)
            if rank is not None and rank > self.d_model:
                raise ValueError(f"{key} = {rank} is larger than d_model = {self.d_model}: the latent compresses a "
                                 f"token's d_model-wide state; set {key} to at most {self.d_model}")
        moe = self.moe
        routing = [f"model.moe.{k} = {getattr(moe, k)!r}" for k, plain in (("scores", "sigmoid"), ("sparse_step", 1),
                   ("dense_layers", None)) if getattr(moe, k) != plain]
        if routing:
            raise ValueError(f"{routing[0]} is not supported by family {self.family!r}: DeepSeek-V3 routes by sigmoid "
                             "scores on every layer from first_dense_layers (first_k_dense_replace) on")
        if self.mup.base_head_dim is not None:
            raise ValueError(f"mup.base_head_dim is not supported by family {self.family!r}: its scores' scale is over "
                             "qk_nope_head_dim + qk_rope_head_dim, not head_dim; leave it unset (base_width applies)")

    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its FFN is the routed one (layers from ``moe.first_dense_layers`` on)."""
        return self.moe.sparse_layers(self.n_layers)

    @property
    def qk_head_dim(self) -> int:
        """A query or key head's width: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def layer_counts(self, layer: int) -> LayerCounts:
        """A DeepSeek-V3 block (``model.mla.MLA`` and a SwiGLU MLP or the routed FFN): the query projection (or its compressing
        and expanding pair), the joint latent + RoPE-key projection, the latent's up-projection into per-head
        keys and values, the output projection; the biases of ``qkv_bias`` on the compressing projections and
        of ``out_bias`` on the output; the latent norms and the block's two norms; on a routed layer the
        router, the shared experts and every expert in place of the MLP (``matmul``: the active weights)."""
        d, h, r, q_rank, f = self.d_model, self.n_heads, self.kv_lora_rank, self.q_lora_rank, self.ffn_hidden
        query = d * h * self.qk_head_dim if q_rank is None else d * q_rank + q_rank * h * self.qk_head_dim
        weights = query + d * (r + self.qk_rope_head_dim) + r * h * (self.qk_nope_head_dim + self.v_head_dim) \
            + h * self.v_head_dim * d + 3 * d * f
        biases = ((q_rank or 0) + r + self.qk_rope_head_dim) * self.qkv_bias + d * self.out_bias
        norms = 2 * d + r + (q_rank or 0)
        if not self.sparse_layers()[layer]:
            return LayerCounts(matrices=weights + biases, norms=norms, matmul=weights)
        attention = weights - 3 * d * f
        routed, active = self.moe.ffn_weights(d, f)  # MoEConfig.ffn_weights: every expert, and a token's
        return LayerCounts(matrices=attention + routed + biases, norms=norms, matmul=attention + active)

    def ffn_activation_bytes(self, compute_bytes: int) -> float:
        """The mean over layers of what autograd keeps per token for the FFN: a dense layer's SwiGLU, a routed
        one's (``MoEConfig.ffn_activation_bytes``)."""
        return self.moe.mean_ffn_activation_bytes(self.n_layers, self.d_model, self.ffn_hidden,
                                                  super().ffn_activation_bytes(compute_bytes), compute_bytes)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls, plus attention's scores (qk_head_dim wide) and
        weighted values (v_head_dim wide) over the sequence, 6·L·H·(qk_head_dim + v_head_dim)·T (PaLM's
        12·L·H·Dh·T when the two widths are equal; the latents expanded, as training computes)."""
        layers = self.n_layers + self.mtp.depth  # the MTP modules' blocks too
        return 6 * self.matmul_params() + 6 * layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
