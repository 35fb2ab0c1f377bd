"""A frozen linear layer whose weight is held quantised, the format a parameter: NF4 or 2-4 bit integers.

``QuantizedLinear`` stores the tensors a format makes of the weight (as buffers) and dequantises
them per layer in the forward pass, and again in the backward (so no full-precision weight is kept
between them): ``y = x · dequant(Ŵ)ᵀ + b``. A format is a small object with ``quantize(weight) ->
tensors`` and ``dequantize(tensors, shape) -> weight``:

- ``NF4Format``: QLoRA's 4-bit NormalFloat with double-quantised block scales (``peft.nf4``,
  bit-identical to torchao's ``to_nf4``);
- ``IntFormat``: 4-, 3- or 2-bit integers with a scale and zero point per group of a row, the
  zero points optimised by HQQ's half-quadratic solver (``peft.lowbit``, bit-identical to hqq's).

``lora.quantize_base`` names the format (``quant_format``); LoRA wraps a ``QuantizedLinear`` as it
wraps an ``nn.Linear`` and merges by dequantising (``lora.merge_lora``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.peft.lowbit import BITS, LowBitWeight, check_lowbit_shape, dequantize_lowbit, quantize_lowbit
from lmforge.peft.nf4 import NF4Weight, check_nf4_shape, dequantize_nf4, quantize_nf4

FORMATS = ("nf4", *(f"int{b}" for b in BITS))


class QuantFormat(Protocol):
    name: str
    bits: int

    def check(self, shape: torch.Size) -> None: ...
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def dequantize(self, tensors: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor: ...


@dataclass(frozen=True)
class NF4Format:
    """NF4 in blocks of ``block_size`` weights, their absmax scales double-quantised in blocks of ``scaler_block_size``."""

    block_size: int = 64
    scaler_block_size: int = 256
    name = "nf4"
    bits = 4

    def check(self, shape: torch.Size) -> None:
        check_nf4_shape(shape, self.block_size, self.scaler_block_size)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_nf4(weight, self.block_size, self.scaler_block_size)
        return {"packed": q.packed, "quantized_scalers": q.quantized_scalers,
                "quantization_factor": q.quantization_factor, "scaler_mean": q.scaler_mean}

    def dequantize(self, tensors: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        return dequantize_nf4(NF4Weight(**tensors, shape=shape, dtype=tensors["scaler_mean"].dtype,
                                        block_size=self.block_size, scaler_block_size=self.scaler_block_size))


@dataclass(frozen=True)
class IntFormat:
    """``bits``-bit integers with a scale and an HQQ-optimised zero point per ``group_size`` weights of a row."""

    bits: int = 4
    group_size: int = 64

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def check(self, shape: torch.Size) -> None:
        check_lowbit_shape(shape, self.bits, self.group_size)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_lowbit(weight, self.bits, self.group_size)
        return {"packed": q.packed, "scale": q.scale, "zero": q.zero}

    def dequantize(self, tensors: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        return dequantize_lowbit(LowBitWeight(**tensors, shape=shape, bits=self.bits, group_size=self.group_size))


def quant_format(name: str, group_size: int = 64, nf4_block_size: int = 64, nf4_scaler_block_size: int = 256) -> QuantFormat:
    """The format ``lora.quantize_base`` names: ``nf4`` (its two block sizes) or ``int4``/``int3``/``int2`` (``group_size``)."""
    if name == "nf4":
        return NF4Format(nf4_block_size, nf4_scaler_block_size)
    if name.startswith("int") and name[3:].isdigit() and int(name[3:]) in BITS:
        return IntFormat(int(name[3:]), group_size)
    raise ValueError(f"no quantised format {name!r}; choose one of {', '.join(FORMATS)}")


class _DequantLinearFunction(torch.autograd.Function):
    """y = x Ŵᵀ with Ŵ dequantised in forward and again in backward; only x gets a gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer  # type: ignore[attr-defined]
        return F.linear(x, layer.dequantized_weight().to(x.dtype))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_out @ ctx.layer.dequantized_weight().to(grad_out.dtype), None  # type: ignore[attr-defined]


class QuantizedLinear(nn.Module):
    """A frozen linear layer with its weight in ``fmt``: y = x · dequant(Ŵ)ᵀ + b.

    Exposes ``in_features``, ``out_features``, ``dtype`` (of the dequantised weight, which follows
    the floating buffers, so ``module.to(torch.bfloat16)`` stays consistent) and
    ``dequantized_weight()``, so LoRA wraps it as it wraps ``nn.Linear``. The format's tensors are
    buffers: they move with ``.to(device)`` and are in ``state_dict``; the optional bias is a frozen
    parameter, added after the matmul (as torchao's ``linear_nf4``).
    """

    def __init__(self, fmt: QuantFormat, tensors: dict[str, torch.Tensor], shape: torch.Size, bias: torch.Tensor | None = None):
        super().__init__()
        if len(shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D (out_features, in_features) weight, got shape {tuple(shape)}")
        self.fmt = fmt
        self.out_features, self.in_features = shape
        self._stored = tuple(tensors)
        for key, value in tensors.items():
            self.register_buffer(key, value)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat) -> QuantizedLinear:
        """Quantise ``linear``'s weight to ``fmt`` (on its device, scales in its dtype) and keep its bias."""
        return cls(fmt, fmt.quantize(linear.weight), linear.weight.shape, linear.bias)

    def stored(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key) for key in self._stored}

    @property
    def dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.stored().values() if t.is_floating_point())

    def dequantized_weight(self) -> torch.Tensor:
        """The (out_features, in_features) weight in ``dtype``, detached (e.g. to merge LoRA)."""
        return self.fmt.dequantize(self.stored(), torch.Size((self.out_features, self.in_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DequantLinearFunction.apply(x, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def nbytes(self) -> int:
        """Bytes of storage of the quantised weight (codes, scales, zeros) plus the bias."""
        tensors = [*self.stored().values(), *([] if self.bias is None else [self.bias])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt}, dtype={self.dtype}")


@torch.no_grad()
def quantize_base_linears(model: nn.Module, fmt: QuantFormat,
                          predicate: Callable[[str, nn.Linear], bool] | None = None) -> int:
    """Replace, in place, each ``nn.Linear`` for which ``predicate(qualified_name, module)`` holds by a ``QuantizedLinear``.

    Only exact ``nn.Linear`` instances are replaced: subclasses (e.g. ``nn.MultiheadAttention.out_proj``)
    are read through ``.weight`` by their owners. A module reachable under several names is quantised
    once and stays shared. Returns the number of distinct modules replaced. A layer whose shape does
    not fit the format raises ``ValueError`` naming it; exclude it with ``predicate``.
    """
    replaced: dict[int, QuantizedLinear] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) not in replaced:
                if predicate is not None and not predicate(name, child):
                    continue
                try:
                    replaced[id(child)] = QuantizedLinear.from_linear(child, fmt)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
            setattr(parent, child_name, replaced[id(child)])
    return len(replaced)


def base_memory(model: nn.Module) -> dict:
    """What the frozen base of a LoRA model holds: its bytes (every parameter and buffer but the
    adapters' and LoftQ's copy of the initial adapter), the weights under the adapters and their
    bytes (codes, scales and zeros of a quantised base; biases aside), bits per adapted weight, and
    the format's name (or none)."""
    from lmforge.peft.lora import ADAPTER_PARAMS, lora_modules  # lora imports this module

    bases = [m.base for m in lora_modules(model).values()]
    adapters = (*ADAPTER_PARAMS, "initial_lora_A", "initial_lora_B")
    tensors = [t for n, t in [*model.named_parameters(), *model.named_buffers()] if not n.endswith(adapters)]
    weights = sum(b.in_features * b.out_features for b in bases)
    stored = sum(sum(t.numel() * t.element_size() for t in b.stored().values()) if isinstance(b, QuantizedLinear)
                 else b.weight.numel() * b.weight.element_size() for b in bases)
    names = sorted({b.fmt.name for b in bases if isinstance(b, QuantizedLinear)})
    return {"format": "/".join(names) or "none", "base_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "adapted_weights": weights, "adapted_weight_bytes": stored,
            "bits_per_adapted_weight": 8 * stored / weights if weights else None}
