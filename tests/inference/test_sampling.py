"""The token draw: inverse transform sampling, one uniform number per row from the row's generator."""

from __future__ import annotations

import pytest
import torch

from lmforge.inference.sampling import draw, inverse_transform, sample_next_token, uniforms

CPU = torch.device("cpu")


def reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The closed form in float64 over the whole row: the first token whose running sum exceeds u x the total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)


@pytest.mark.parametrize("V", [5, 128, 300, 1000])
def test_the_token_is_the_first_whose_cumulative_probability_exceeds_u(V):
    probs = torch.rand(256, V, generator=torch.Generator().manual_seed(V)) ** 4  # unnormalised, uneven
    u = torch.rand(256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = inverse_transform(probs, u)
    # only the float32 rounding of a block's sum (~1e-7 of its mass) may move a boundary
    assert (tokens == reference(probs, u)).float().mean() >= 0.99
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_a_token_of_probability_zero_is_never_chosen_even_at_the_ends_of_u():
    V = 300
    probs = torch.rand(V, generator=torch.Generator().manual_seed(0))
    probs[::3] = 0
    probs[:128] = 0  # a whole block
    probs[-20:] = 0
    nonzero = probs.nonzero().squeeze(1)
    u = torch.tensor([0.0, 1 - 2**-53, *torch.rand(998, dtype=torch.float64).tolist()], dtype=torch.float64)
    tokens = inverse_transform(probs.expand(len(u), V).contiguous(), u)
    assert tokens[:2].tolist() == [int(nonzero[0]), int(nonzero[-1])]
    assert bool((probs[tokens] > 0).all())


def test_draw_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    tokens = draw(probs.expand(40000, 5).contiguous(), [torch.Generator().manual_seed(0)] * 40000)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    assert freq[1] == 0


def test_rows_sharing_a_generator_draw_in_row_order_wherever_they_sit():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    interleaved = uniforms(4, [gens[0], gens[1], gens[0], gens[1]], CPU)
    first, second = (torch.rand(2, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (1, 2))
    assert torch.equal(interleaved, torch.stack((first[0], second[0], first[1], second[1])))


def test_a_seeded_draw_is_reproducible():
    probs = torch.rand(16, 700).softmax(-1)
    a = draw(probs, [torch.Generator().manual_seed(3)] * 16)
    assert torch.equal(a, draw(probs, [torch.Generator().manual_seed(3)] * 16))
    assert not torch.equal(a, draw(probs, [torch.Generator().manual_seed(4)] * 16))


@pytest.mark.parametrize("setting", [{"top_p": 7.6e-66}, {"temperature": 1e-40}, {"temperature": 1e-300}],
                         ids=["top-p-below-float32", "temperature-denormal", "temperature-below-float32"])
def test_a_vanishing_top_p_or_temperature_samples_the_most_likely_token(setting):
    # a top_p that rounds to 0 in float32 once dropped every token, and logits / 1e-40 overflowed
    # to inf - inf = NaN: the draw indexed past the vocabulary and failed the whole batch's step
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    tokens = sample_next_token(logits, generator=torch.Generator().manual_seed(1), **setting)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
