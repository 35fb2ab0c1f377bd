"""The parts every family's Hugging Face mapping is built from (``model/families/*/hf.py``).

How import classifies a ``config.json`` key (``HFKey``: honoured, refused unless at a value
lmforge computes, or inert) and refuses the keys it does not know; ``PretrainedConfig``'s own
keys, inert for every family; RoPE and its scaling between ``ModelConfig``'s ``rope_*``
fields and ``rope_scaling`` / ``rope_parameters``, as transformers' ``ROPE_INIT_FUNCTIONS`` read them;
``WeightNames``, the weights' names where ours and the class's map one to one; and ``HFExperts``,
a mixture's stacked experts against the class's per-expert (or fused) tensors.
It never imports ``transformers``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.model.config import ROPE_SCALING_FIELDS, ModelConfig

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------- config.json keys

HONOURED, REFUSED, INERT = "honoured", "refused", "inert"


class HFKey(NamedTuple):
    """How import treats one ``config.json`` key: ``honoured`` (read into ModelConfig), ``refused``
    unless it is one of ``supported`` (lmforge computes only those; any other value is an InputError),
    or ``inert`` (no effect on the logits of the class transformers builds for this model_type)."""

    kind: str
    why: str
    # the values lmforge computes, or a test of (value, config.json); () = any value (honoured keys: any their reader takes)
    supported: tuple | Callable[[Any, dict], bool] = ()


def refused(why: str, *supported: Any) -> HFKey:
    """A key lmforge computes only at ``supported``: the values, or one test of (value, config.json)."""
    return HFKey(REFUSED, why, supported[0] if len(supported) == 1 and callable(supported[0]) else supported)


INERT_BASE = dict.fromkeys(  # PretrainedConfig's own keys (transformers 4 and 5): metadata, outputs, generation, heads
    """_name_or_path transformers_version dtype torch_dtype use_bfloat16 _attn_implementation_autoset attn_implementation
    output_attentions output_hidden_states return_dict torchscript tf_legacy_loss chunk_size_feed_forward
    is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size tie_encoder_decoder
    id2label label2id num_labels problem_type finetuning_task task_specific_params tokenizer_class prefix
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id use_cache
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k
    top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens""".split(),
    HFKey(INERT, "metadata, outputs, generation defaults or token ids (a pad id only zeroes its embedding row at init)"),
)
NOT_READ = HFKey(INERT, "this model_type's transformers class does not read it")
# keys of every family: the base class's, the class selection, and what no family computes
COMMON_KEYS = {
    **INERT_BASE,
    "model_type": HFKey(HONOURED, "selects the family and class (lmforge.model.hf.SUPPORTED_ARCHITECTURES)"),
    "architectures": HFKey(HONOURED, "must name the class of model_type"),
    "initializer_range": HFKey(INERT, "the init std of training from scratch (kept as init_std)"),
    "quantization_config": refused("quantized weights; use the unquantized (bf16/fp16/fp32) ones", None, {}),
    "pruned_heads": refused("pruned attention heads change the projections' shapes", None, {}),
    "auto_map": refused("custom modelling code computes this model, not the transformers class (tokenizer entries are fine)",
                        lambda v, _: isinstance(v, dict) and not any(k.startswith(("AutoConfig", "AutoModel")) for k in v)),
}


def supports(spec: HFKey, value: Any, config: dict) -> bool:
    """Whether lmforge computes ``value`` of a key classified ``spec`` in ``config``."""
    if callable(spec.supported):
        return spec.supported(value, config)
    return not spec.supported or value in spec.supported


def check_hf_config_keys(config: dict, known: dict[str, HFKey], model_type: str, where: str) -> None:
    """Refuse a key set to a value lmforge does not compute, and a key lmforge does not know, rather than drop it."""
    for key, value in config.items():
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        spec = known.get(key)
        if spec is None:
            raise InputError(
                f"{where}: key {key!r} = {shown} is not one lmforge knows for model_type {model_type!r}: lmforge does not "
                "know what it does to the arithmetic (a newer transformers may read it), so it refuses rather than drop it"
            )
        if not supports(spec, value, config):
            listed = not callable(spec.supported)
            supported = f"; lmforge supports {' or '.join(json.dumps(s) for s in spec.supported)}" if listed else ""
            raise InputError(f"{where}: {key} = {shown} is not supported ({spec.why}){supported}")




# ModelConfig's rope_* field -> its key in rope_scaling / rope_parameters
HF_ROPE_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim",
    "rope_attention_factor": "attention_factor",
    "rope_truncate": "truncate",
    "rope_short_factor": "short_factor",
    "rope_long_factor": "long_factor",
}
HF_ROPE_TYPES = {"default": "none", **{t: t for t in ROPE_SCALING_FIELDS if t != "none"}}  # rope_type -> rope_scaling


def hf_max_position_embeddings(cfg: ModelConfig) -> int:
    """``max_position_embeddings``: the context, except for dynamic NTK, whose transformers
    implementation grows the base past ``max_position_embeddings``: there it is the original context."""
    return cfg.rope_original_max_seq_len if cfg.rope_scaling == "dynamic" else cfg.max_seq_len


def rope_scaling_keys(cfg: ModelConfig) -> dict:
    """``rope_scaling`` (transformers < 5, and Meta's own configs) and ``rope_parameters``
    (transformers >= 5) for a model with RoPE scaling: the keys its type reads; nothing for plain RoPE."""
    if cfg.rope_scaling == "none":
        return {}
    scaling = {"rope_type": cfg.rope_scaling}
    for name in sorted(ROPE_SCALING_FIELDS[cfg.rope_scaling]):
        if getattr(cfg, name) is not None and not (cfg.rope_scaling == "dynamic" and name == "rope_original_max_seq_len"):
            scaling[HF_ROPE_KEYS[name]] = getattr(cfg, name)
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def rope_fields(config: dict, max_position_embeddings: int, where: str) -> dict:
    """The ModelConfig rope_* fields of a config.json, resolved as transformers' ``ROPE_INIT_FUNCTIONS``
    read them; unknown RoPE types and partial rotary are an ``InputError``.

    transformers >= 5 writes ``rope_parameters``; older versions and Meta's configs write
    ``rope_scaling`` beside a top-level ``rope_theta``. Where both are present
    ``rope_scaling`` wins, as in transformers 5's ``convert_rope_params_to_dict``. The original
    context of llama3, yarn and longrope is a top-level ``original_max_position_embeddings`` (Phi-3
    writes it there), else the one in ``rope_scaling``, else ``max_position_embeddings``; dynamic
    NTK's is ``max_position_embeddings``. yarn's and longrope's missing ``factor`` is the ratio of
    ``max_position_embeddings`` to the original context; yarn's ``beta_fast``/``beta_slow`` default
    to 32 and 1, and its ``mscale`` pair counts only when both are set, as in transformers.
    """
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"{where}: rope_scaling/rope_parameters must be a mapping, got {rope!r}")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta") or config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        raise InputError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported; RoPE must cover the whole head")
    if rope_type not in HF_ROPE_TYPES:
        raise InputError(
            f"{where}: RoPE scaling {rope_type!r} is not supported; lmforge implements rope_type "
            f"{', '.join(map(repr, HF_ROPE_TYPES))} (plain RoPE, position interpolation, dynamic NTK, YaRN, LongRoPE, Llama 3.1)"
        )
    if rope_type == "default":
        return {"rope_theta": float(theta)}
    reads = ROPE_SCALING_FIELDS[rope_type]
    ignored = sorted(set(rope) - {HF_ROPE_KEYS[k] for k in reads} - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if ignored:
        log.warning("%s: RoPE scaling %r does not read %s (transformers ignores them too)", where, rope_type, ", ".join(ignored))
    required = {"linear": ["factor"], "dynamic": ["factor"], "yarn": [], "longrope": ["short_factor", "long_factor"],
                "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}[rope_type]
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise InputError(f"{where}: RoPE scaling {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "dynamic":
        original = max_position_embeddings
    else:
        original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_position_embeddings
    try:
        fields = {
            "rope_theta": float(theta),
            "rope_scaling": rope_type,
            "rope_factor": float(rope["factor"] if rope.get("factor") is not None else max_position_embeddings / original),
            "rope_original_max_seq_len": int(original),
        }
        if rope_type == "llama3":
            fields |= {"rope_low_freq_factor": float(rope["low_freq_factor"]), "rope_high_freq_factor": float(rope["high_freq_factor"])}
        if rope_type == "yarn":
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            fields |= {
                "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
                "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
                "rope_truncate": bool(rope.get("truncate", True)),
                "rope_mscale": float(mscale) if mscale and mscale_all_dim else None,
                "rope_mscale_all_dim": float(mscale_all_dim) if mscale and mscale_all_dim else None,
            }
        if rope_type == "longrope":
            fields |= {"rope_short_factor": [float(x) for x in rope["short_factor"]],
                       "rope_long_factor": [float(x) for x in rope["long_factor"]]}
        if rope_type in ("yarn", "longrope") and rope.get("attention_factor") is not None:
            fields["rope_attention_factor"] = float(rope["attention_factor"])
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: RoPE scaling {rope_type!r} has a non-numeric parameter in {rope}: {exc}") from exc
    if "rope_original_max_seq_len" not in reads:
        del fields["rope_original_max_seq_len"]
    return fields



# --------------------------------------------------------------------------- weight names

# the embedding, final norm and head: the same names in every decoder class of transformers here
HF_TOP_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
# a block's projections (ours -> the Llama-style classes'): q/k/v/o and gate/up/down, weights and biases
HF_PROJECTION_KEYS = {
    **{f"attn.w{p}.{t}": f"self_attn.{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias")},
    **{f"mlp.{ours}.{t}": f"mlp.{theirs}_proj.{t}" for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
       for t in ("weight", "bias")},
}
# per-head QK-norm gains (Qwen3's, Gemma 3's)
HF_QK_NORM_KEYS = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


@dataclass(frozen=True)
class WeightNames:
    """A family's parameter names in its Hugging Face class where the two map one to one:
    ``layer`` maps a block's (``attn.wq.weight``) to the class's (``self_attn.q_proj.weight``)
    under ``layers.<i>.`` and ``model.layers.<i>.``; ``top`` the rest. ``hf_class`` names the
    class in the errors."""

    hf_class: str
    layer: dict[str, str]
    top: dict[str, str] = field(default_factory=lambda: dict(HF_TOP_KEYS))

    def to_hf(self, name: str) -> str:
        """``layers.3.attn.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``KeyError`` for no such name."""
        if name in self.top:
            return self.top[name]
        parts = name.split(".", 2)  # layers.<i>.<rest>
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in self.layer:
            raise KeyError(f"no Hugging Face {self.hf_class} parameter for lmforge parameter {name!r}")
        return f"model.layers.{parts[1]}.{self.layer[parts[2]]}"

    def from_hf(self, name: str) -> str:
        """The inverse of ``to_hf``."""
        top = {theirs: ours for ours, theirs in self.top.items()}
        if name in top:
            return top[name]
        layer = {theirs: ours for ours, theirs in self.layer.items()}
        parts = name.split(".", 3)  # model.layers.<i>.<rest>
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in layer:
            raise KeyError(f"no lmforge parameter for Hugging Face {self.hf_class} parameter {name!r}")
        return f"layers.{parts[2]}.{layer[parts[3]]}"

    def state_to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Weights under the class's names; a tied output matrix is left out, as ``save_pretrained`` does."""
        out = {self.to_hf(k): v for k, v in state.items()}
        if cfg.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def state_from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """The class's weights under our names (less the RoPE buffer some older checkpoints saved);
        a tied output matrix becomes the embedding matrix."""
        out = {self.from_hf(k): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_embeddings:
            out["lm_head.weight"] = out["embed.weight"]
        return out


# --------------------------------------------------------------------------- a mixture's experts


class HFExperts:
    """A mixture's expert matrices between our stacked ``layers.<i>.mlp.experts.w1|w3|w2`` (E, out, in)
    and a Hugging Face class's: each expert's ``model.layers.<i>.<module>.experts.<e>.<name>.weight``
    (the layout ``save_pretrained`` writes and the Hub holds), or, read only, transformers 5's fused
    ``experts.gate_up_proj`` (E, 2f, d: each expert's gate rows, then its up rows) and ``experts.down_proj``.

    ``module``: the MoE module's name in the class (``mlp``, Mixtral's ``block_sparse_moe``), written and read;
    ``also_read``: other names a reader accepts (transformers 5's Mixtral fuses its experts under ``mlp``);
    ``names``: ours -> the class's per-expert names."""

    def __init__(self, module: str, names: dict[str, str], also_read: tuple[str, ...] = ()):
        import re

        self.module, self.names = module, names
        self.ours = {theirs: mine for mine, theirs in names.items()}
        prefix = rf"model\.layers\.(\d+)\.(?:{'|'.join(map(re.escape, (module, *also_read)))})\.experts\."
        self.per_expert = re.compile(prefix + rf"(\d+)\.({'|'.join(map(re.escape, self.ours))})\.weight")
        self.fused = re.compile(prefix + r"(gate_up_proj|down_proj)")

    def to_hf(self, layer: str, ours: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
        """One stacked matrix kind of layer ``layer`` as each expert's tensor under the class's name."""
        return {f"model.layers.{layer}.{self.module}.experts.{e}.{self.names[ours]}.weight": matrix.contiguous()
                for e, matrix in enumerate(stacked.unbind(0))}

    def from_hf(self, state: dict[str, torch.Tensor], n_experts: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``state``'s expert tensors under our names, stacked by expert (or split from the fused layout), and
        the rest of ``state``; a ``KeyError`` names an expert missing, past the config's count, or of
        another shape than the others."""
        ours: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        found: dict[tuple[str, str], dict[int, tuple[str, torch.Tensor]]] = {}
        for key, value in state.items():
            if m := self.per_expert.fullmatch(key):
                found.setdefault((m[1], self.ours[m[3]]), {})[int(m[2])] = (key, value)
            elif (m := self.fused.fullmatch(key)) and m[2] == "down_proj":
                ours[f"layers.{m[1]}.mlp.experts.w2"] = value
            elif m:
                if value.ndim != 3 or value.shape[1] % 2:
                    raise KeyError(f"{key} has shape {tuple(value.shape)}; expected (experts, 2 * the experts' width, "
                                   "hidden size)")
                ours[f"layers.{m[1]}.mlp.experts.w1"], ours[f"layers.{m[1]}.mlp.experts.w3"] = value.chunk(2, dim=1)
            else:
                rest[key] = value
        for (layer, name), by_expert in found.items():
            ours[f"layers.{layer}.mlp.experts.{name}"] = stack_experts(by_expert, n_experts, layer)
        return ours, rest


def stack_experts(by_expert: dict[int, tuple[str, torch.Tensor]], n_experts: int, layer: str) -> torch.Tensor:
    """One matrix kind of a layer's experts, expert number -> (its HF name, its tensor), as one (E, out, in) tensor."""
    import torch

    missing = [e for e in range(n_experts) if e not in by_expert]
    extra = sorted(e for e in by_expert if e >= n_experts)
    if missing or extra:
        named = by_expert[next(iter(by_expert))][0]
        problem = f"expert {missing[0]} missing" if missing else f"expert {extra[0]} past the config's {n_experts}"
        raise KeyError(f"layer {layer}'s experts ({named} and the others): {problem}")
    first_name, first = by_expert[0]
    for name, t in by_expert.values():
        if t.shape != first.shape:
            raise KeyError(f"{name} has shape {tuple(t.shape)}, unlike {first_name}'s {tuple(first.shape)}")
    return torch.stack([by_expert[e][1] for e in range(n_experts)])
