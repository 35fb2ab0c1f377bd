"""NF4 quantisation anchored to torchao's `to_nf4` / `linear_nf4` (pure PyTorch, runs on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.peft.nf4 import NF4_CODEBOOK, NF4_CODEBOOK_PAPER, dequantize_nf4, quantize_nf4
from lmforge.peft.quant import NF4Format, QuantizedLinear, quantize_base_linears
from tests.conftest import import_reference

torchao_quant = import_reference("torchao.quantization")
to_nf4 = torchao_quant.to_nf4

# (shape, block_size, scaler_block_size): the QLoRA defaults and torchao's own tiny-test blocks.
CASES = [((256, 256), 64, 256), ((512, 128), 64, 256), ((16, 8), 32, 2), ((4, 64), 32, 2)]
DTYPES = [torch.float32, torch.bfloat16]


def _weight(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def test_codebook_is_torchaos_and_within_rounding_of_the_paper():
    nf4 = to_nf4(_weight((32, 2), torch.float32), 32, 2).nf4
    assert torch.equal(torch.tensor(NF4_CODEBOOK), nf4)
    assert torch.allclose(torch.tensor(NF4_CODEBOOK), torch.tensor(NF4_CODEBOOK_PAPER), atol=5e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "block_size", "scaler_block_size"), CASES)
def test_dequantised_weight_equals_torchao_exactly(shape, block_size, scaler_block_size, dtype):
    w = _weight(shape, dtype)
    ours = dequantize_nf4(quantize_nf4(w, block_size, scaler_block_size))
    ref = to_nf4(w, block_size, scaler_block_size).get_original_weight()
    assert ours.dtype == dtype and ours.shape == w.shape
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "block_size", "scaler_block_size"), CASES)
def test_packed_codes_and_double_quantised_scales_equal_torchaos_tensors(shape, block_size, scaler_block_size, dtype):
    w = _weight(shape, dtype, seed=1)
    q = quantize_nf4(w, block_size, scaler_block_size)
    ref = to_nf4(w, block_size, scaler_block_size)
    for ours, theirs in [
        (q.packed, ref.quantized_data),
        (q.quantized_scalers, ref.quantized_scalers),
        (q.quantization_factor, ref.quantization_factor),
        (q.scaler_mean, ref.scaler_mean),
    ]:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs)


def test_first_element_goes_in_the_high_nibble():
    w = torch.zeros(64, 1)
    w[0], w[1], w[2] = -1.0, 1.0, 0.0796  # codes 0, 15, 8
    q = quantize_nf4(w.view(-1), block_size=64, scaler_block_size=1)
    assert q.packed[0].item() == 0x0F and q.packed[1].item() == 0x87


def test_dequantisation_error_is_small_relative_to_the_weight():
    w = _weight((256, 256), torch.float32)
    err = (dequantize_nf4(quantize_nf4(w)) - w).abs().mean() / w.abs().mean()
    assert err < 0.1


def test_all_zero_block_dequantises_to_exact_zeros():
    w = _weight((256, 256), torch.float32)
    w[0, :64] = 0.0
    out = dequantize_nf4(quantize_nf4(w))
    assert torch.equal(out[0, :64], torch.zeros(64))
    assert torch.equal(out[1:], to_nf4(w, 64, 256).get_original_weight()[1:])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_linear_output_and_input_grad_equal_torchao(dtype, bias):
    linear = nn.Linear(256, 128, bias=bias, dtype=dtype)
    layer = QuantizedLinear.from_linear(linear, NF4Format())
    ref_w = to_nf4(linear.weight.detach(), 64, 256)
    ref_b = linear.bias.detach() if bias else None

    x = torch.randn(3, 5, 256, dtype=dtype, generator=torch.Generator().manual_seed(2))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours = layer(x_ours)
    y_ref = F.linear(x_ref, ref_w, ref_b)  # torchao routes this through linear_nf4
    assert y_ours.dtype == dtype and torch.equal(y_ours, y_ref)

    grad = torch.randn_like(y_ours)
    y_ours.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(x_ours.grad, x_ref.grad)
    assert all(not p.requires_grad and p.grad is None for p in layer.parameters())
    assert all(not b.requires_grad for b in layer.buffers())


def test_nf4_linear_runs_in_the_input_dtype():
    layer = QuantizedLinear.from_linear(nn.Linear(128, 128), NF4Format())  # fp32 storage
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, layer.dequantized_weight().to(x.dtype)) + layer.bias.to(x.dtype))


def test_nf4_linear_exposes_the_adapter_interface_and_a_state_dict():
    layer = QuantizedLinear.from_linear(nn.Linear(256, 64, bias=False), NF4Format())
    assert (layer.in_features, layer.out_features) == (256, 64)
    assert layer.dequantized_weight().shape == (64, 256)
    clone = QuantizedLinear.from_linear(nn.Linear(256, 64, bias=False), NF4Format())
    clone.load_state_dict(layer.state_dict())
    assert torch.equal(clone.dequantized_weight(), layer.dequantized_weight())


@pytest.mark.parametrize("dtype", DTYPES)
def test_1024x1024_base_takes_half_a_byte_per_parameter_plus_scales(dtype):
    n = 1024 * 1024
    layer = QuantizedLinear.from_linear(nn.Linear(1024, 1024, bias=False, dtype=dtype), NF4Format())
    # codes + int8 scaler per 64-block + one factor per 256 scalers (in the weight dtype, as torchao) + mean
    expected = n // 2 + n // 64 + (n // (64 * 256)) * dtype.itemsize + dtype.itemsize
    assert layer.nbytes() == expected
    ref = to_nf4(torch.zeros(1024, 1024, dtype=dtype) + 1e-3, 64, 256)
    ref_bytes = sum(
        t.numel() * t.element_size()
        for t in (ref.quantized_data, ref.quantized_scalers, ref.quantization_factor, ref.scaler_mean)
    )
    assert layer.nbytes() == ref_bytes
    print(f"NF4 1024x1024 {dtype}: {layer.nbytes()} bytes = {layer.nbytes() / n:.4f} bytes/param")
    assert 0.515 < layer.nbytes() / n < 0.517


@pytest.mark.parametrize(
    ("shape", "block_size", "scaler_block_size", "message"),
    [
        ((10, 10), 64, 256, r"shape \(10, 10\) \(100 elements\).*block_size=64"),
        ((128, 64), 64, 256, r"shape \(128, 64\).*128 blocks of block_size=64.*scaler_block_size=256"),
        ((64,), 7, 1, r"block_size must be a positive even number"),
    ],
)
def test_shapes_that_do_not_divide_into_blocks_raise_naming_shape_and_block(
    shape, block_size, scaler_block_size, message
):
    with pytest.raises(ValueError, match=message):
        quantize_nf4(torch.randn(shape), block_size, scaler_block_size)


class _TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"q": nn.Linear(128, 128), "up": nn.Linear(128, 256)}) for _ in range(2)
        )
        self.head = nn.Linear(128, 10)  # 1280 elements: would not fit 64x256 blocks
        self.alias = self.blocks[0]["q"]


def test_quantize_base_linears_replaces_matching_linears_only():
    model = _TinyModel()
    x = torch.randn(4, 128)
    up = model.blocks[1]["up"]
    ref_w, ref_b = to_nf4(up.weight.detach(), 64, 256), up.bias.detach()
    n = quantize_base_linears(model, NF4Format(), lambda name, m: not name.startswith("head"))
    assert n == 4
    assert isinstance(model.blocks[1]["up"], QuantizedLinear) and type(model.head) is nn.Linear
    assert model.alias is model.blocks[0]["q"]  # shared module stays shared
    assert torch.equal(model.blocks[1]["up"](x), F.linear(x, ref_w, ref_b))
    assert not any(p.requires_grad for n, p in model.named_parameters() if not n.startswith("head"))


def test_quantize_base_linears_names_a_layer_that_does_not_fit():
    with pytest.raises(ValueError, match=r"^head: .*shape \(10, 128\)"):
        quantize_base_linears(_TinyModel(), NF4Format())
