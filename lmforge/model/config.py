"""The transformer's shape and the arithmetic users ask of it (params, FLOPs).

``ModelConfig`` holds the fields of the shared parts (attention, MLP, norms, positions) and is
the config of the Llama family; another family's config is a subclass that adds its own fields
(``lmforge.model.families``). The ``family`` key of a recipe's ``model:`` section picks the class;
a preset names its family. ``param_counts`` is the one parameter count: ``num_params``, the
memory planner, MFU and ``lmforge scaling flops`` all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from lmforge.core.config import at_least, check_ranges, option, positive, unit_interval
from lmforge.model.mtp import MTPConfig, mtp_config


@dataclass(frozen=True)
class LayerCounts:
    """The parameters of one block: its linears' weights and biases (split by tensor parallelism),
    its norms' gains and biases (replicated), and the weights that take part in its matmuls
    (per token; a mixture of experts' active ones)."""

    matrices: int
    norms: int
    matmul: int

    @property
    def total(self) -> int:
        return self.matrices + self.norms


@dataclass(frozen=True)
class ParamCounts:
    """Every parameter of a model by where it sits; the output matrix, when tied, counted once (as the embedding)."""

    layers: tuple[LayerCounts, ...]
    embedding: int  # the token embedding
    positions: int  # learned absolute positions (GPT-2), else 0
    head: int  # the output matrix, 0 when tied to the embedding
    head_matmul: int  # the output matrix's weights as a matmul (tied or not)
    final_norm: int

    def total(self, include_embedding: bool = True) -> int:
        lookups = self.embedding + self.positions if include_embedding else 0
        return sum(layer.total for layer in self.layers) + self.final_norm + self.head + lookups

    @property
    def matmul(self) -> int:
        """Weights that take part in matmuls per token: every projection plus the output head."""
        return sum(layer.matmul for layer in self.layers) + self.head_matmul


@dataclass
class MupConfig:
    """``model.mup``: the maximal-update parameterisation (µP; Yang et al. 2021, "Tensor Programs V",
    Table 8 with ``MuReadout``) of a model ``m = d_model / base_width`` times as wide as the one whose
    learning rate and ``init_std`` were tuned, so those carry over to the wider model (µTransfer):

    - hidden matrices (the blocks' 2-D weights): init std ``init_std / √m`` (variance ∝ 1/fan_in),
      learning rate ``lr / m`` under Adam (``train.optim.mup_lr_multiplier``);
    - embeddings, norms, biases and the head: init and learning rate as at the base width;
    - the head's output multiplied by ``1 / m`` (its input scaled so, before the matmul);
    - attention scores scaled ∝ 1/head_dim: ``√base_head_dim / head_dim`` where ``base_head_dim`` is set
      (the head width grows with the model), else the family's own scale (heads are added instead).

    At ``d_model = base_width`` (and ``head_dim = base_head_dim``) every rule is the identity: the
    model is the standard one. ``base_width: null`` (the default) is the standard parameterisation.
    """

    base_width: int | None = positive(None, help="the d_model the recipe's lr and init_std were tuned at; "
                                      "null = the standard parameterisation")
    base_head_dim: int | None = positive(None, help="the head_dim at base_width when heads widen with the model "
                                         "(attention scale √base_head_dim / head_dim); null = heads are added instead")

    @property
    def enabled(self) -> bool:
        return self.base_width is not None


@dataclass
class ModelConfig:
    """A decoder-only transformer.

    In a recipe, ``preset: <name>`` fills the fields the preset names and keys written
    beside it win; in Python use ``ModelConfig.from_preset(name, **overrides)``.
    """

    family: str = option("llama", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")
    preset: str | None = option(None, help="a named shape; `lmforge import --help` lists each family's presets")
    vocab_size: int = positive(8192, help="rows of the token embedding (at least the tokenizer's vocabulary)")
    d_model: int = positive(384, help="the width of the residual stream")
    n_layers: int = positive(6, help="transformer blocks")
    n_heads: int = positive(6, help="query heads per attention layer")
    n_kv_heads: int | None = positive(None, help="None = n_heads (MHA); 1 = MQA; in between = GQA")
    head_dim: int | None = positive(None, help="None = d_model // n_heads")
    ffn: Literal["swiglu", "gelu"] = option("swiglu", help="swiglu: the gated MLP of Llama; gelu: GPT-2's")
    ffn_hidden: int | None = positive(None, help="None = 8/3 d_model rounded up to 64 (SwiGLU) or 4 d_model (GELU)")
    norm: Literal["rmsnorm", "layernorm"] = option("rmsnorm", help="rmsnorm (Llama) or layernorm (GPT-2)")
    norm_eps: float = positive(1e-5, help="the epsilon added to the variance in every norm")
    positions: Literal["rope", "alibi", "learned"] = option(
        "rope",
        help="rope = rotary embeddings (rope_*); "
        "alibi = ALiBi's per-head linear distance bias (Press et al. 2022), no rotation; "
        "learned = a trained embedding per position added to the tokens' (GPT-2), max_seq_len of them",
    )
    rope_theta: float = positive(10000.0, help="RoPE's base θ: pair i turns by position · θ^(-2i / head_dim)")
    rope_scaling: Literal["none", "linear", "dynamic", "yarn", "longrope", "llama3"] = option(
        "none",
        help="how RoPE stretches past rope_original_max_seq_len (model.rope): linear = position interpolation (PI), "
        "dynamic = NTK-aware base growing with the sequence, yarn, longrope (Phi-3), llama3 (Llama 3.1)",
    )
    rope_factor: float = at_least(
        1,
        1.0,
        help="how many times the context is stretched (linear, dynamic, yarn, llama3: Llama 3.1/3.2 use 8 or 32; "
        "longrope: sets the attention factor)",
    )
    rope_low_freq_factor: float = positive(
        1.0, help="llama3: wavelengths above rope_original_max_seq_len / this are fully stretched"
    )
    rope_high_freq_factor: float = positive(
        4.0, help="llama3: wavelengths below rope_original_max_seq_len / this are kept"
    )
    rope_original_max_seq_len: int | None = positive(
        None, help="the context the model was pretrained at (Llama 3: 8192); dynamic, yarn, longrope, llama3"
    )
    rope_beta_fast: float = positive(
        32.0, help="yarn: RoPE pairs turning more than this many times over the original context keep their frequency"
    )
    rope_beta_slow: float = positive(1.0, help="yarn: pairs turning fewer than this many times are fully interpolated")
    rope_mscale: float | None = positive(
        None,
        help="yarn (DeepSeek): with rope_mscale_all_dim, attention factor (0.1 mscale ln s + 1) / "
        "(0.1 mscale_all_dim ln s + 1)",
    )
    rope_mscale_all_dim: float | None = positive(
        None, help="yarn (DeepSeek): the denominator's mscale, set with rope_mscale"
    )
    rope_attention_factor: float | None = positive(
        None,
        help="yarn, longrope: scale of RoPE's cos and sin (None = the paper's: yarn 0.1 ln s + 1, "
        "longrope sqrt(1 + ln s / ln L))",
    )
    rope_truncate: bool = option(
        True, help="yarn: round the ends of the interpolation ramp to whole pairs (transformers' default)"
    )
    rope_short_factor: list[float] | None = positive(
        None, help="longrope: head_dim/2 divisors of the frequencies, for sequences up to rope_original_max_seq_len"
    )
    rope_long_factor: list[float] | None = positive(
        None, help="longrope: head_dim/2 divisors of the frequencies, for longer sequences"
    )
    max_seq_len: int = positive(2048, help="the longest sequence the model takes (its context)")
    sliding_window: int | None = positive(
        None,
        help="a sliding layer's query sees the last this many positions, itself included (Mistral, Qwen2); "
        "None = every layer sees all",
    )
    layer_types: list[Literal["sliding_attention", "full_attention"]] | None = option(
        None, help="one per layer (transformers' layer_types); None = every layer sliding when sliding_window is set"
    )
    tie_embeddings: bool = option(False, help="the output head shares the token embedding's weights")
    qk_norm: bool = option(False, help="RMSNorm on each head's queries and keys before attention (Qwen3)")
    qkv_bias: bool = option(False, help="biases on the query/key/value projections (Qwen2 has them)")
    out_bias: bool = option(False, help="bias on the attention output projection")
    mlp_bias: bool = option(False, help="biases on the MLP's linears")
    embed_dropout: float = unit_interval(0.0, high_open=True, help="dropout on the embedding's output (training only)")
    attn_dropout: float = unit_interval(0.0, high_open=True, help="dropout on the attention probabilities (training only)")
    resid_dropout: float = unit_interval(
        0.0, high_open=True, help="dropout on each attention and MLP output before the residual add (training only)"
    )
    init_std: float = positive(0.02, help="the standard deviation of the weights' normal initialisation")
    mup: MupConfig = option(default_factory=MupConfig, help="µP's base width (model.mup.base_width); unset = standard")
    mtp: MTPConfig = option(default_factory=MTPConfig, help="multi-token prediction modules (model.mtp.depth, "
                            "model.mtp.loss_weight; lmforge.model.mtp); depth 0 = none")

    def __post_init__(self) -> None:
        from lmforge.model.families import FAMILIES, PRESETS  # the registry imports this module

        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        family = FAMILIES.get(self.family)
        if family is None:
            raise ValueError(f"unknown model family {self.family!r}; choose one of {', '.join(FAMILIES)}")
        if type(self) is not family.config:
            raise TypeError(f"family {self.family!r} is configured by {family.config.__name__}, not {type(self).__name__} "
                            "(lmforge.model.families.model_config builds the right one from a mapping)")
        if isinstance(self.mup, dict):  # read back from a checkpoint's model_config.json
            self.mup = MupConfig(**self.mup)
        self.mtp = mtp_config(self.mtp)
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
        if self.head_dim % 2 and self.positions == "rope":
            raise ValueError(f"head_dim = {self.head_dim} must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.d_model if self.ffn == "gelu" else 64 * -(-(8 * self.d_model // 3) // 64)
        self._check_rope_scaling()
        self._check_attention_pattern()
        self._check_mup()

    def _check_mup(self) -> None:
        base, base_head = self.mup.base_width, self.mup.base_head_dim
        if base is None:
            if base_head is not None:
                raise ValueError("model.mup.base_head_dim is set but model.mup.base_width is not; µP needs the base width")
            return
        if base > self.d_model:
            raise ValueError(f"model.mup.base_width = {base} is larger than model.d_model = {self.d_model}: µP scales "
                             "up from a narrower base model (set base_width to the width the rates were tuned at)")
        if base_head is not None and base_head > self.head_dim:
            raise ValueError(f"model.mup.base_head_dim = {base_head} is larger than head_dim = {self.head_dim}: µP "
                             "scales up from the base model's heads")

    def width_mult(self) -> float:
        """µP's width multiplier ``m = d_model / model.mup.base_width``; 1 under the standard parameterisation."""
        return self.d_model / self.mup.base_width if self.mup.enabled else 1.0

    def _check_attention_pattern(self) -> None:
        if self.positions != "rope" and self.rope_scaling != "none":
            raise ValueError(f"rope_scaling {self.rope_scaling!r} set but positions is {self.positions!r}, which has no RoPE "
                             "to scale; set rope_scaling to 'none' or positions to 'rope'")
        if self.sliding_window is not None and not 1 <= self.sliding_window <= self.max_seq_len:
            raise ValueError(f"sliding_window = {self.sliding_window} must be in [1, max_seq_len = {self.max_seq_len}] "
                             "(a window as long as the context is full attention: set it to null)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries; it needs one per layer, "
                                 f"n_layers = {self.n_layers} ('sliding_attention' or 'full_attention')")
            if self.sliding_window is None and "sliding_attention" in self.layer_types:
                raise ValueError("layer_types names 'sliding_attention' layers but sliding_window is not set; "
                                 "set sliding_window or make every layer 'full_attention'")

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within ``sliding_window`` only."""
        if self.sliding_window is None:
            return (False,) * self.n_layers
        if self.layer_types is None:
            return (True,) * self.n_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def _check_rope_scaling(self) -> None:
        reads = ROPE_SCALING_FIELDS.get(self.rope_scaling)
        if reads is None:
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not supported; choose one of {', '.join(map(repr, ROPE_SCALING_FIELDS))}")
        defaults = {f.name: f.default for f in fields(self) if f.name in ROPE_SCALING_KEYS}
        unread = [f"{k}={getattr(self, k)}" for k in ROPE_SCALING_KEYS if k not in reads and getattr(self, k) != defaults[k]]
        if unread:
            readers = sorted({t for t, keys in ROPE_SCALING_FIELDS.items() for k in unread if k.split("=")[0] in keys})
            raise ValueError(
                f"{', '.join(unread)} set but rope_scaling is {self.rope_scaling!r}, which does not read "
                f"{'it' if len(unread) == 1 else 'them'}; set rope_scaling to {' or '.join(readers)} or remove "
                f"{'it' if len(unread) == 1 else 'them'}"
            )
        if "rope_original_max_seq_len" in reads and self.rope_original_max_seq_len is None:
            raise ValueError(
                f"rope_scaling {self.rope_scaling} needs rope_original_max_seq_len, the pretraining context "
                "(a positive integer, 8192 for Llama 3.1/3.2)"
            )
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor = {self.rope_low_freq_factor} must be below rope_high_freq_factor = "
                f"{self.rope_high_freq_factor} (Llama 3.1/3.2: 1 and 4)"
            )
        if self.rope_scaling == "yarn" and (self.rope_mscale is None) != (self.rope_mscale_all_dim is None):
            raise ValueError("rope_mscale and rope_mscale_all_dim set YaRN's attention factor together; set both or neither")
        if self.rope_scaling == "longrope":
            for key in ("rope_short_factor", "rope_long_factor"):
                factors = getattr(self, key)
                if factors is None or len(factors) != self.head_dim // 2:
                    got = "none" if factors is None else f"{len(factors)}"
                    raise ValueError(
                        f"rope_scaling longrope needs {key}, one factor per RoPE pair: "
                        f"head_dim / 2 = {self.head_dim // 2} numbers, got {got}"
                    )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """The config of preset ``name`` (of whichever family names it), ``overrides`` on top."""
        from lmforge.model.families import model_config

        return model_config({**cls.expand_preset({"preset": name}), **overrides})

    @classmethod
    def expand_preset(cls, data: dict) -> dict:
        """Recipe hook (see ``core.config.from_dict``): the preset's fields (its family included) under the user's keys."""
        from lmforge.model.families import PRESETS

        name = data.get("preset")
        if name is None:
            return data
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return {**PRESETS[name], **data}

    @classmethod
    def class_for(cls, data: dict) -> type[ModelConfig]:
        """Recipe hook (see ``core.config.from_dict``): the config class of the section's ``family``."""
        from lmforge.model.families import FAMILIES

        name = data.get("family", "llama")
        if not isinstance(name, str) or name not in FAMILIES:
            raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
        return FAMILIES[name].config

    # -- arithmetic
    def layer_counts(self, layer: int) -> LayerCounts:
        """Block ``layer``'s parameters, as the shared parts build it (``model.transformer.Block``); a
        family whose blocks hold more (post-norms, experts) overrides this, and a test holds every
        family's counts to its built model's."""
        d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_hidden
        n_mats = 3 if self.ffn == "swiglu" else 2
        weights = 2 * d * h * hd + 2 * d * kv * hd + n_mats * d * f
        biases = (h * hd + 2 * kv * hd) * self.qkv_bias + d * self.out_bias + ((n_mats - 1) * f + d) * self.mlp_bias
        norms = 2 * self.norm_params(d) + 2 * hd * self.qk_norm
        return LayerCounts(matrices=weights + biases, norms=norms, matmul=weights)

    def ffn_activation_bytes(self, compute_bytes: int) -> float:
        """Bytes per token autograd keeps for a block's FFN between its forward and backward (the memory
        planner's): SwiGLU's w1 x, silu, w3 x and their product, GELU's w1 x and gelu; a family whose FFN
        differs (a mixture of experts) overrides this with its mean over the layers."""
        return compute_bytes * self.ffn_hidden * (4 if self.ffn == "swiglu" else 2)

    def norm_params(self, dim: int) -> int:
        """Parameters of one norm over ``dim`` features: a gain (RMSNorm), or a gain and a bias (LayerNorm)."""
        return dim * (2 if self.norm == "layernorm" else 1)

    def param_counts(self) -> ParamCounts:
        """Every parameter by where it sits: the one count ``num_params``, the memory planner, MFU and scaling read."""
        embedding = self.vocab_size * self.d_model
        return ParamCounts(
            layers=tuple(self.layer_counts(i) for i in range(self.n_layers)) + (self.mtp_counts(),) * self.mtp.depth,
            embedding=embedding,
            positions=self.max_seq_len * self.d_model if self.positions == "learned" else 0,
            head=0 if self.tie_embeddings else embedding,
            head_matmul=embedding,
            final_norm=self.norm_params(self.d_model),
        )

    def mtp_counts(self) -> LayerCounts:
        """One multi-token prediction module (``model.mtp``): a block of the last layer's kind, the d x 2d projection
        and three RMSNorm gains; its matmuls in training also run the shared head once more."""
        block, d = self.layer_counts(self.n_layers - 1), self.d_model
        return LayerCounts(matrices=block.matrices + 2 * d * d, norms=block.norms + 3 * d,
                           matmul=block.matmul + 2 * d * d + self.vocab_size * d)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count; the (possibly tied) output matrix is counted once."""
        return self.param_counts().total(include_embedding)

    def matmul_params(self) -> int:
        """Weights that take part in matmuls: every projection plus the output head (not norms, biases, lookups)."""
        return self.param_counts().matmul

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·H·Dh·T for attention (PaLM, App. B),
        where a sliding layer's T is at most its window."""
        keys = sum(min(seq_len, self.sliding_window) if s else seq_len for s in self.sliding_layers())
        keys += seq_len * self.mtp.depth  # the MTP modules' blocks attend to the whole window
        return 6 * self.matmul_params() + 12 * self.n_heads * self.head_dim * keys



# the rope_* keys each rope_scaling type reads (besides rope_theta); any other set away from its default is refused
ROPE_SCALING_FIELDS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "linear": frozenset({"rope_factor"}),
    "dynamic": frozenset({"rope_factor", "rope_original_max_seq_len"}),
    "yarn": frozenset({"rope_factor", "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                       "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate"}),
    "longrope": frozenset({"rope_factor", "rope_original_max_seq_len", "rope_attention_factor", "rope_short_factor",
                           "rope_long_factor"}),
    "llama3": frozenset({"rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"}),
}
ROPE_SCALING_KEYS = sorted(set().union(*ROPE_SCALING_FIELDS.values()))
