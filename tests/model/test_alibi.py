"""ALiBi (Press et al. 2022): the paper's head slopes for any head count, the bias BLOOM adds to
the attention scores, through the same ``attend`` path in training and decoding (cached decoding
is checked in test_parity.py and tests/inference), training that learns, and one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer, alibi_slopes, positions_and_mask
from tests.model.test_hf import randomized

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


@pytest.mark.parametrize("n_heads", [*range(1, 21), 24, 32, 40, 48, 64, 96])
def test_slopes_are_blooms_for_any_head_count(n_heads):
    # build_alibi_tensor is slope_h * (key position); at position 1 it is the slope itself. BLOOM rounds
    # its base to float32 and raises it to powers up to 2n - 1 in float32, which multiplies that rounding
    # (2^-24 relative) by the power; lmforge computes in float64 and rounds once
    theirs = bloom.build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(n_heads), theirs, atol=0, rtol=2 * n_heads * 2.0**-24)


def test_slopes_are_the_papers_geometric_sequences_rounded_once():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    exact16 = [2.0 ** (-i / 2) for i in range(1, 17)]  # 2^(-8/16 i)
    assert alibi_slopes(16).tolist() == torch.tensor(exact16).tolist()
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5)
    exact12 = [2.0**-i for i in range(1, 9)] + [2.0 ** (-i / 2) for i in (1, 3, 5, 7)]
    assert alibi_slopes(12).tolist() == torch.tensor(exact12).tolist()


def reference_attention(attn, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """BLOOM's ALiBi attention on our projections: softmax(q kᵀ / √d + build_alibi_tensor) over real, earlier keys."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.wq(x).view(B, T, H, D).transpose(1, 2)
    k = attn.wk(x).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = attn.wv(x).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    alibi = bloom.build_alibi_tensor(real.long(), H, torch.float32).view(B, H, 1, T)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + alibi
    seen = torch.ones(T, T, dtype=torch.bool).tril() & real[:, None, None, :]
    seen = seen | torch.eye(T, dtype=torch.bool)  # a padding query sees itself, as positions_and_mask lets it
    y = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1) @ v
    return attn.wo(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (6, 2), (12, 3)])
@torch.no_grad()
def test_attention_adds_blooms_bias_in_a_plain_and_a_left_padded_batch(n_heads, n_kv_heads):
    cfg = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8,
                      max_seq_len=32, positions="alibi")
    model = randomized(cfg, matrix_std=0.2)
    x = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    seen = {}
    model.layers[1].attn.register_forward_hook(lambda m, args, out: seen.update(input=args[0], output=out))
    model(x)
    real = torch.ones(2, 13, dtype=torch.bool)
    torch.testing.assert_close(seen["output"], reference_attention(model.layers[1].attn, seen["input"], real),
                               atol=1e-5, rtol=0)
    real[1, :4] = False  # left padding
    positions, mask = positions_and_mask(real)
    model(x, positions=positions, attn_mask=mask)
    expected = reference_attention(model.layers[1].attn, seen["input"], real)
    torch.testing.assert_close(seen["output"][real], expected[real], atol=1e-5, rtol=0)


@torch.no_grad()
def test_alibi_has_no_rotation_and_its_bias_follows_distance_only():
    """Shifting a sequence right by padding changes no real position's logits (relative bias, no absolute positions)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, positions="alibi")
    model = randomized(cfg, matrix_std=0.2)
    x = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    alone = model(x)
    padded = torch.cat((torch.zeros(1, 5, dtype=torch.long), x), dim=1)
    real = padded != 0
    _, mask = positions_and_mask(real)
    torch.testing.assert_close(model(padded, attn_mask=mask)[:, 5:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 6], ids=["alibi", "alibi-sliding-window"])
def test_an_alibi_model_trains(window):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, positions="alibi",
                      sliding_window=window)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 25), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_alibi_with_rope_scaling_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"^rope_scaling 'linear' set but positions is 'alibi'.*set rope_scaling to 'none'") as err:
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, positions="alibi", rope_scaling="linear", rope_factor=2.0)
    assert "\n" not in str(err.value)
