"""2-4 bit integer bases anchored to hqq 0.2.8's own quantiser (``Quantizer``, ``HQQLinear``) on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.peft.lowbit import dequantize_lowbit, pack_codes, quantize_lowbit, unpack_codes
from lmforge.peft.quant import IntFormat, QuantizedLinear, quant_format
from tests.conftest import import_reference

hqq = import_reference("hqq.core.quantize")

# (shape, group_size): HQQ's default group, a smaller one, and a row count (60 groups) that 10 does not divide.
CASES = [((64, 128), 64), ((48, 96), 32), ((30, 32), 16)]
BITS = [4, 3, 2]


def _weight(shape: tuple[int, int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def _hqq_linear(weight: torch.Tensor, bits: int, group_size: int, bias: torch.Tensor | None = None):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    config = hqq.BaseQuantizeConfig(nbits=bits, group_size=group_size)
    return hqq.HQQLinear(linear, config, compute_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("shape", "group_size"), CASES)
def test_packed_codes_scales_and_zeros_equal_hqqs(shape, group_size, bits):
    w = _weight(shape)
    config = hqq.BaseQuantizeConfig(nbits=bits, group_size=group_size)["weight_quant_params"]
    ref_packed, meta = hqq.Quantizer.quantize(w.clone(), device="cpu", **config)
    q = quantize_lowbit(w, bits, group_size)
    assert q.packed.dtype == ref_packed.dtype and torch.equal(q.packed, ref_packed)
    assert torch.equal(q.scale, meta["scale"]) and torch.equal(q.zero, meta["zero"])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("shape", "group_size"), CASES)
def test_dequantised_weight_equals_hqq_linears_exactly(shape, group_size, bits):
    w = _weight(shape, seed=1)
    assert torch.equal(dequantize_lowbit(quantize_lowbit(w, bits, group_size)), _hqq_linear(w, bits, group_size).dequantize())


@pytest.mark.parametrize("bits", BITS)
def test_bf16_weights_get_hqqs_codes_and_its_scales_rounded_to_bf16(bits):
    w = _weight((32, 64), torch.bfloat16, seed=2)
    config = hqq.BaseQuantizeConfig(nbits=bits, group_size=32)["weight_quant_params"]
    ref_packed, meta = hqq.Quantizer.quantize(w.clone(), device="cpu", **config)  # hqq quantises w.float()
    q = quantize_lowbit(w, bits, 32)
    assert torch.equal(q.packed, ref_packed)
    assert q.scale.dtype == torch.bfloat16 and torch.equal(q.scale, meta["scale"].bfloat16())
    assert torch.equal(q.zero, meta["zero"].bfloat16())
    assert dequantize_lowbit(q).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", BITS)
def test_codes_pack_and_unpack_as_hqqs_bitpack(bits):
    codes = torch.randint(0, 2**bits, (40, 8), generator=torch.Generator().manual_seed(3))
    pack = {4: hqq.BitPack.pack_4bit_u8, 3: hqq.BitPack.pack_3bit_32, 2: hqq.BitPack.pack_2bit_u8}[bits]
    assert torch.equal(pack_codes(codes, bits), pack(codes))
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 40, torch.int64), codes)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_int_linear_output_and_input_grad_equal_hqq_linears(bits, bias):
    w, b = _weight((48, 64), seed=4), (torch.randn(48) * 0.1 if bias else None)
    ours = QuantizedLinear.from_linear(_hqq_source(w, b), IntFormat(bits, 32))
    ref = _hqq_linear(w, bits, 32, b)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(5))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_ref = ours(x_ours), ref(x_ref)
    # the same dequantised W (exactly); F.linear and hqq's matmul may sum the 64 products in another
    # order, so ~64 · 2^-24 relative to |x||w| ~ 1e-6 at these sizes
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(y_ours)
    y_ours.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    assert all(not p.requires_grad for p in ours.parameters())


def _hqq_source(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


@pytest.mark.parametrize(("bits", "bytes_per_group"), [(4, 32), (3, None), (2, 16)])
def test_a_base_takes_bits_per_weight_plus_a_scale_and_zero_per_group(bits, bytes_per_group):
    layer = QuantizedLinear.from_linear(nn.Linear(256, 128, bias=False), IntFormat(bits, 64))
    groups = 128 * 256 // 64
    codes = groups * bytes_per_group if bytes_per_group else 4 * -(-groups // 10) * 64  # ten 3-bit codes per int32
    assert layer.nbytes() == codes + groups * 2 * 4  # fp32 scale and zero per group
    assert layer.nbytes() / (128 * 256) == pytest.approx(bits / 8 + 8 / 64, rel=0.08)  # 3 bits pack as 3.2


def test_error_grows_as_the_bits_fall_and_hqqs_zero_beats_min_max():
    w = _weight((64, 256), seed=6)
    errors = [(dequantize_lowbit(quantize_lowbit(w, b, 64)) - w).abs().mean() for b in BITS]
    assert errors[0] < errors[1] < errors[2] < w.abs().mean()


def test_a_bit_width_or_group_size_the_quantiser_lacks_is_refused_naming_it():
    with pytest.raises(ValueError, match="5-bit integers are not a width of this quantiser; choose one of 4, 3, 2"):
        quantize_lowbit(torch.randn(8, 64), 5, 64)
    with pytest.raises(ValueError, match=r"group_size=48 does not divide the weight's width \(in_features\) 64"):
        QuantizedLinear.from_linear(nn.Linear(64, 8), IntFormat(2, 48))
    with pytest.raises(ValueError, match="no quantised format 'int5'; choose one of nf4, int4, int3, int2"):
        quant_format("int5")


def test_a_quantised_base_moves_with_to_and_keeps_its_codes():
    layer = QuantizedLinear.from_linear(nn.Linear(64, 16), IntFormat(3, 32))
    codes, weight, step = layer.packed.clone(), layer.dequantized_weight(), layer.scale.max()
    layer.to(torch.bfloat16)
    assert layer.dtype == torch.bfloat16 and torch.equal(layer.packed, codes)
    # (q − z)·s with z and s rounded to bf16 (2^-8 relative), q and z at most 7: within 14·2^-8 steps, + the result's rounding
    torch.testing.assert_close(layer.dequantized_weight().float(), weight, rtol=2**-8, atol=float(step) * 14 / 256)
