"""LoRA, rsLoRA and DoRA adapters on ``nn.Linear``, numerically the same as PEFT's.

LoRA (Hu et al. 2021) freezes W and learns a low-rank update: ``y = W x + b + s·B A x``
with A (r, in), B (out, r), ``s = α/r``. rsLoRA (Kalajdzievski 2023) uses ``s = α/√r`` so
the update's scale does not shrink as r grows. DoRA (Liu et al. 2024) also learns each
output row's length: ``W' = m · (W + s·BA) / ‖W + s·BA‖`` (row norms).

``apply_lora(model, cfg)`` wraps the matching linears of a built model in place and
freezes everything else; ``merge_lora`` folds the adapters back into plain linears for
export; ``lora_state_dict`` is what a training run needs to save. The formulas, init,
dropout placement and merge follow ``peft/tuners/lora/layer.py`` (``Linear``) and
``peft/tuners/lora/dora.py``/``variants.py`` (``DoraLinearLayer``/``DoraLinearVariant``);
``tests/peft/test_lora.py`` checks them against PEFT in float64.

QLoRA (Dettmers et al. 2023) is the same adapter over a frozen quantised base
(``QuantizedLinear``): ``LoraConfig(quantize_base="nf4")`` (or ``True``) stores each targeted
linear in NF4 before wrapping it, ``"int4"``/``"int3"``/``"int2"`` in HQQ's integers
(``peft.quant``), and the matmuls run in the activations' dtype (bf16 under autocast). With
``init="loftq"`` the base and the adapter are chosen together from the quantisation residual
(``peft.loftq``). A quantised base is never merged in place (that would round the update into
the base's bits, peft#2321); ``merge_lora`` dequantises and returns a full-precision
``nn.Linear``, PEFT's dequantise-then-merge. ``tests/peft/test_qlora.py`` checks it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import option, positive, unit_interval
from lmforge.peft.loftq import loftq_init
from lmforge.peft.quant import FORMATS, QuantFormat, QuantizedLinear, quant_format

DEFAULT_TARGETS = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"]
ADAPTER_PARAMS = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")


@dataclass
class LoraConfig:
    """Which linears get an adapter and how it is shaped.

    ``target_modules`` entries match module names relative to the model (``layers.0.attn.wq``)
    as a suffix at a dot boundary (``attn.wq``, ``wq``) or as an fnmatch glob over the whole
    name (``layers.[01].mlp.*``); a single string is a full-match regex, as in PEFT.
    Defaults follow torchtune's LoRA configs (r 8, α 16, dropout 0) on every projection.
    """

    r: int = positive(8, help="the adapters' rank")
    alpha: float = positive(16.0, help="α: the adapter's update is scaled by α/r")
    dropout: float = unit_interval(0.0, high_open=True, help="dropout on the adapter's input")
    target_modules: list[str] | str = option(
        default_factory=lambda: list(DEFAULT_TARGETS),
        help="the linears that get an adapter: module-name suffixes or globs, or one full-match regex",
    )
    use_rslora: bool = option(False, help="s = α/√r instead of α/r")
    use_dora: bool = option(False, help="DoRA: the adapted weight's magnitude is learned apart from its direction")
    init: Literal["kaiming", "gaussian", "loftq"] = option(
        "kaiming",
        help="A's init, B starting at zero (kaiming, gaussian); or loftq (with quantize_base): the base and both "
        "factors chosen from the quantisation residual, so the model starts near the full-precision one",
    )
    quantize_base: bool | Literal["nf4", "int4", "int3", "int2"] = option(
        False,
        help="store each targeted linear's weight quantised under the adapter: nf4 (QLoRA's NormalFloat, "
        "double-quantised scales; true means nf4; a weight needs a multiple of nf4_block_size·nf4_scaler_block_size "
        "elements) or int4/int3/int2 (HQQ: a scale and zero point per group_size weights of a row)",
    )
    group_size: int = positive(
        64, help="quantize_base int4/int3/int2: weights per group along a row, each group with its own scale and zero "
        "point; must divide every targeted linear's in_features")
    loftq_iter: int = positive(1, help="init loftq: alternations of quantising W − BA and the SVD of the residual")
    nf4_block_size: int = positive(64, help="quantize_base: weights per NF4 block, each with its own scale")
    nf4_scaler_block_size: int = positive(
        256, help="quantize_base: NF4 blocks per block of their scales, themselves quantised (double quantisation)"
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.init not in ("kaiming", "gaussian", "loftq"):
            raise ValueError(f"LoRA init {self.init!r} is unknown; choose 'kaiming', 'gaussian' or 'loftq'")
        if self.quantize_base not in (False, True, *FORMATS):
            raise ValueError(f"lora.quantize_base {self.quantize_base!r} is not a format; choose one of {', '.join(FORMATS)}")
        if self.init == "loftq" and not self.quantize_base:
            raise ValueError("lora.init=loftq initialises from the quantisation residual; set lora.quantize_base "
                             f"({', '.join(FORMATS)}) or choose another init")

    @property
    def base_format(self) -> QuantFormat | None:
        """The quantised format of the targeted bases (``quantize_base``), or None for a full-precision base."""
        if not self.quantize_base:
            return None
        name = "nf4" if self.quantize_base is True else self.quantize_base
        return quant_format(name, self.group_size, self.nf4_block_size, self.nf4_scaler_block_size)

    @property
    def scaling(self) -> float:
        """s = α/r, or α/√r with rsLoRA (PEFT ``LoraLayer.update_layer``)."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` or ``QuantizedLinear`` (QLoRA) plus a trainable low-rank update (and, with DoRA, a magnitude).

    LoRA:  ``y = W x + b + s · B A drop(x)``
    DoRA:  ``y = (m/n) ⊙ (W x′ + s · B A x′) + b``, ``n = ‖W + s·BA‖`` per output row, held
    constant in the backward pass (DoRA §4.3). ``x′ = drop(x)``; as in PEFT, when dropout is
    active the base term is recomputed on ``x′``, otherwise the base output is reused.
    W is read through ``base_weight()``: the dequantised weight for a quantised base.
    """

    def __init__(
        self,
        base: nn.Linear | QuantizedLinear,
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        use_rslora: bool = False,
        use_dora: bool = False,
        init: Literal["kaiming", "gaussian"] = "kaiming",
    ):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.r, self.alpha, self.use_dora = r, alpha, use_dora
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        # Adapters live on the base's device in the dtype W is read in: an nn.Linear's weight dtype,
        # a QuantizedLinear's dequantisation dtype. So a bf16-stored base gets bf16 adapters (as torchtune
        # does); for fp32 master weights keep the base in fp32 and run the forward under autocast.
        reference = next(t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point())
        weight_dtype = base.weight.dtype if isinstance(base, nn.Linear) else base.dtype
        factory = {"device": reference.device, "dtype": weight_dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **factory)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters(init)
        self.lora_magnitude_vector: nn.Parameter | None = None
        if use_dora:  # m = ‖W + s·BA‖ = ‖W‖ at B = 0, so DoRA starts as the base model
            self.lora_magnitude_vector = nn.Parameter(self.weight_norm())
        self.merged = False
        self.disabled = False  # set by disable_adapters(): the layer computes the model training started from
        # LoftQ's initial s·B₀A₀, which the quantised base was chosen to go with (``start_from``); None otherwise
        self.register_buffer("initial_lora_A", None)
        self.register_buffer("initial_lora_B", None)
        self._merged_norm: torch.Tensor | None = None  # DoRA's n at merge time, needed to unmerge

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @torch.no_grad()
    def reset_lora_parameters(self, init: Literal["kaiming", "gaussian"] = "kaiming") -> None:
        """PEFT ``reset_lora_parameters``: A ~ kaiming_uniform(a=√5) (nn.Linear's init) or N(0, std=1/r); B = 0, so training starts at the base model."""
        if init == "kaiming":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        elif init == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.r)
        else:
            raise ValueError(f"LoRA init {init!r} is unknown; choose 'kaiming' or 'gaussian'")
        nn.init.zeros_(self.lora_B.weight)

    @property
    def quantized(self) -> bool:
        """Whether the frozen base is stored quantised (QLoRA)."""
        return isinstance(self.base, QuantizedLinear)

    def base_weight(self) -> torch.Tensor:
        """The frozen (out, in) weight W: ``nn.Linear.weight``, or a quantised base dequantised (a fresh tensor)."""
        return self.base.dequantized_weight() if self.quantized else self.base.weight

    def delta_weight(self) -> torch.Tensor:
        """s · B @ A, the (out, in) update LoRA adds to W."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def weight_norm(self) -> torch.Tensor:
        """n = ‖W + s·BA‖₂ per output row, with no gradient to W, A or B (DoRA §4.3)."""
        with torch.no_grad():
            weight = self.base_weight()
            lora_weight = self.lora_B.weight @ self.lora_A.weight
            return torch.linalg.norm(weight + self.scaling * lora_weight, dim=1).to(weight.dtype)

    @torch.no_grad()
    def start_from(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Set A and B (LoftQ's), and keep them: with the adapters disabled the layer computes
        W x + s·B₀A₀ x, where training started, since the quantised base alone is quant(W − B₀A₀)."""
        self.lora_A.weight.copy_(lora_a)
        self.lora_B.weight.copy_(lora_b)
        self.initial_lora_A, self.initial_lora_B = self.lora_A.weight.clone(), self.lora_B.weight.clone()
        if self.lora_magnitude_vector is not None:  # DoRA starts where LoRA does: m = ‖W + s·B₀A₀‖
            self.lora_magnitude_vector.copy_(self.weight_norm())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.disabled and self.initial_lora_A is not None:
            return result + F.linear(F.linear(x, self.initial_lora_A), self.initial_lora_B) * self.scaling
        if self.merged or self.disabled:
            return result
        if self.lora_magnitude_vector is None:
            return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result + self._dora_extra(x, result)

    def _dora_extra(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """``(m/n − 1)·W x′ + (m/n)·s·B A x′``: what DoRA adds to ``W x + b`` (bias left unscaled)."""
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base_out = result if self.base.bias is None else result - self.base.bias
        else:
            x = self.lora_dropout(x)
            base_out = F.linear(x, self.base_weight())
        scale = (self.lora_magnitude_vector / self.weight_norm()).view(1, -1)
        lora_out = self.lora_B(self.lora_A(x))
        return (scale - 1) * base_out + scale * lora_out * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + s·BA, or (m/n)(W + s·BA) with DoRA: the plain weight that computes the same function."""
        base_weight = self.base_weight()
        if self.merged:
            return base_weight.detach().clone()
        weight = base_weight + self.delta_weight()
        if self.lora_magnitude_vector is not None:
            weight = (self.lora_magnitude_vector / self.weight_norm()).view(-1, 1) * weight
        return weight.to(base_weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into the base weight in place (exact only in eval: dropout acts on x)."""
        if self.merged:
            return
        if self.quantized:
            raise RuntimeError(
                f"merge(): this LoRA layer's base is {self.base.fmt.name}; merging into it would re-quantise the "
                "update and lose most of it (peft#2321). Use merge_lora(model), which returns a "
                "full-precision nn.Linear with dequant(W) + s·BA"
            )
        if self.lora_magnitude_vector is not None:
            self._merged_norm = self.weight_norm()
        self.base.weight.copy_(self.merged_weight())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo ``merge``: W = W′ − s·BA, or W′·(n/m) − s·BA with DoRA (n as cached at merge)."""
        if not self.merged:
            return
        weight = self.base.weight.clone()
        if self.lora_magnitude_vector is not None:
            weight = weight / (self.lora_magnitude_vector / self._merged_norm).view(-1, 1)
            self._merged_norm = None
        self.base.weight.copy_(weight - self.delta_weight())
        self.merged = False

    def extra_repr(self) -> str:
        return (
            f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, dora={self.use_dora}, "
            f"quantized={self.base.fmt.name if self.quantized else None}, merged={self.merged}"
        )


# --------------------------------------------------------------------------- whole models


def matches_target(name: str, target_modules: list[str] | str) -> bool:
    """Whether module ``name`` is selected (see ``LoraConfig.target_modules``)."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) or fnmatch.fnmatchcase(name, t) for t in target_modules)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap every ``nn.Linear`` (or ``QuantizedLinear``) whose name matches in a ``LoraLinear``; freeze all else.

    With ``cfg.quantize_base`` (QLoRA) each matched ``nn.Linear`` is first replaced by a
    ``QuantizedLinear`` in that format (with ``cfg.init == "loftq"``, quantise(W − BA) and its
    adapter from ``loftq_init``); untargeted layers (embeddings, an untargeted ``lm_head``) stay as
    they are. Returns the wrapped module names. Raises ``ValueError`` naming the candidates when
    nothing matches, when a target's weight is shared (a tied ``lm_head``), since merging
    into it would also change the embedding, and when a target's shape does not fit the
    format's blocks or groups; the model is left unchanged in these cases.
    """
    inside_lora = {n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    candidates = [
        n for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, QuantizedLinear)) and not any(n.startswith(p + ".") for p in inside_lora)
    ]
    names = [n for n in candidates if matches_target(n, cfg.target_modules)]
    if not names:
        shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in candidates})
        raise ValueError(
            f"LoRA target_modules {cfg.target_modules!r} matched no nn.Linear in {type(model).__name__}; "
            f"linear layers are: {', '.join(shown) or 'none'}"
        )
    uses = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    fmt = cfg.base_format
    linears = {name: model.get_submodule(name) for name in names}
    for name, linear in linears.items():  # check every target before changing the model
        if isinstance(linear, nn.Linear) and uses[id(linear.weight)] > 1:
            raise ValueError(f"LoRA target {name!r} shares its weight with another module (tied embeddings); leave it out of target_modules")
        if fmt is not None and isinstance(linear, nn.Linear):
            check_fits(fmt, name, linear.weight.shape)
    if cfg.init == "loftq" and any(isinstance(m, QuantizedLinear) for m in linears.values()):
        raise ValueError("lora.init=loftq needs the full-precision weights, but some targets are quantised already")
    for name, linear in linears.items():
        init = "kaiming" if cfg.init == "loftq" else cfg.init
        factors = None
        if fmt is not None and isinstance(linear, nn.Linear):
            if cfg.init == "loftq":
                tensors, *factors = loftq_init(linear.weight, fmt, cfg.r, cfg.scaling, cfg.loftq_iter)
                linear = QuantizedLinear(fmt, tensors, linear.weight.shape, linear.bias)
            else:
                linear = QuantizedLinear.from_linear(linear, fmt)
        wrapped = LoraLinear(linear, cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora, cfg.use_dora, init)
        if factors is not None:
            wrapped.start_from(*factors)
        model.set_submodule(name, wrapped)
    for pname, p in model.named_parameters():
        p.requires_grad_(pname.endswith(ADAPTER_PARAMS))
    return names


def check_fits(fmt: QuantFormat, name: str, shape: torch.Size) -> None:
    """``ValueError`` naming target ``name`` and the keys to change when its weight does not fit ``fmt``'s blocks or groups."""
    try:
        fmt.check(shape)
    except ValueError as e:
        keys = "lora.group_size" if fmt.name != "nf4" else "lora.nf4_block_size/lora.nf4_scaler_block_size"
        raise ValueError(f"QLoRA cannot quantise target {name!r} to {fmt.name}: {e}. Change {keys} or leave "
                         f"{name!r} out of target_modules") from e


def check_quantizable(cfg: LoraConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Before a stage writes anything: each targeted 2-D weight of a checkpoint (its parameter shapes
    by name) fits ``cfg``'s base format (``check_fits``); ``apply_lora`` checks the built model again."""
    fmt = cfg.base_format
    if fmt is None:
        return
    for key, shape in shapes.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and len(shape) == 2 and matches_target(name, cfg.target_modules):
            check_fits(fmt, name, torch.Size(shape))


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The ``LoraLinear`` wrappers of ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base inside the block (PEFT's ``disable_adapter()``).

    The reference model of DPO/KTO with LoRA: the same weights without the adapters, so
    no second copy of the model is held in memory. Merged adapters cannot be disabled. A LoftQ
    layer keeps its initial adapter (``LoraLinear.start_from``), so the reference is the model
    training started from, not its quantised residual.
    """
    layers = lora_modules(model).values()
    if any(layer.merged for layer in layers):
        raise RuntimeError("disable_adapters: some adapters are merged into the base weights; unmerge them first")
    for layer in layers:
        layer.disabled = True
    try:
        yield
    finally:
        for layer in layers:
            layer.disabled = False


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Replace each ``LoraLinear`` by a plain ``nn.Linear`` with the merged weight, for export.

    A quantised (QLoRA) base is dequantised first: the new weight is dequant(W) + s·BA (DoRA:
    (m/n)(dequant(W) + s·BA)) in the dequantisation dtype, so the merged model computes what the
    QLoRA model computed, not what the original full-precision W would have. The new linears
    are frozen like their bases. Returns the merged names.
    """
    names = []
    for name, module in lora_modules(model).items():
        base = module.base
        weight = module.merged_weight()
        plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device=weight.device, dtype=weight.dtype)
        plain.weight.copy_(weight)
        if base.bias is not None:
            plain.bias.copy_(base.bias)
        plain.requires_grad_(not module.quantized and base.weight.requires_grad)
        model.set_submodule(name, plain)
        names.append(name)
    return names


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (``<module>.lora_A.weight``, ``.lora_B.weight``, ``.lora_magnitude_vector``)."""
    return {k: v.detach() for k, v in model.state_dict().items() if k.endswith(ADAPTER_PARAMS)}
