"""The gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", section 2 and appendix A), measured from gradients the step computes anyway.

The loss is a mean over examples, so a batch of B examples gives an unbiased gradient estimate
G_B with covariance Σ/B, where Σ is the per-example covariance. Hence

    E|G_B|² = |G|² + tr(Σ)/B,

and two batch sizes B_small < B_big with their gradients' squared norms give unbiased estimates
of both parts (appendix A):

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and the simple noise scale B_simple = tr(Σ)/|G|², the batch size at which the noise of a
step's gradient is as large as the gradient itself. It equals the paper's B_noise when the
Hessian is a multiple of the identity, and the critical batch size, beyond which larger
batches stop paying, is about B_noise.

Each measurement is noisy (the |G|² estimate is often negative alone), so, as the paper does,
the two estimates are smoothed by exponential moving averages *separately* and only their
averages divided.

In the loop the small batch is the step's first micro-batch (over every data-parallel rank),
the big batch the whole step (all ``grad_accum`` micro-batches), so it needs ``grad_accum >= 2``
and costs one squared gradient norm after the first micro-batch's backward, at the steps it is
measured; |G_big|² is the step's gradient norm before clipping, already computed. Batch sizes
are counted in target **tokens** (the loss is a mean per target token), so B_simple is in
tokens, as the paper's and Kaplan et al.'s language-model figures are.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class NoiseSample(NamedTuple):
    """One step's two gradients: the squared norms of the mean gradients of a small and a big
    batch (the big one containing the small one is allowed: each expectation holds alone) and
    the batch sizes, in target tokens."""

    b_small: float
    b_big: float
    grad_sq_small: float  # |G_small|²
    grad_sq_big: float  # |G_big|²


def gradient_sq_estimate(s: NoiseSample) -> float:
    """Unbiased |G|²: (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)."""
    return (s.b_big * s.grad_sq_big - s.b_small * s.grad_sq_small) / (s.b_big - s.b_small)


def trace_estimate(s: NoiseSample) -> float:
    """Unbiased tr(Σ) of the per-token gradient: (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)."""
    return (s.grad_sq_small - s.grad_sq_big) / (1.0 / s.b_small - 1.0 / s.b_big)


def simple_noise_scale(trace: float, grad_sq: float) -> float | None:
    """B_simple = tr(Σ)/|G|²; None while the |G|² estimate is not positive (no meaningful ratio)."""
    return trace / grad_sq if grad_sq > 0 else None


class NoiseScale:
    """Exponential moving averages (``decay`` per measurement, bias-corrected as Adam's moments)
    of the |G|² and tr(Σ) estimates, and B_simple from their ratio. Its ``state_dict`` goes into
    the checkpoint, so a resumed run reports what an uninterrupted one does."""

    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"noise scale decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.grad_sq = self.trace = 0.0  # the moving averages, before bias correction
        self.count = 0  # measurements taken

    def observe(self, sample: NoiseSample) -> dict[str, float]:
        """Fold in one step's sample; return the step record's fields (none for a non-finite
        sample, an fp16 overflow or a NaN step, which are left out of the averages)."""
        grad_sq, trace = gradient_sq_estimate(sample), trace_estimate(sample)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return {}
        d = self.decay
        self.grad_sq = d * self.grad_sq + (1 - d) * grad_sq
        self.trace = d * self.trace + (1 - d) * trace
        self.count += 1
        return self.fields()

    def averages(self) -> tuple[float, float]:
        """The bias-corrected averages of |G|² and tr(Σ) (the correction cancels in their ratio)."""
        correction = 1.0 - self.decay ** self.count
        return self.grad_sq / correction, self.trace / correction

    def fields(self) -> dict[str, float]:
        """``noise_grad_sq``, ``noise_trace`` and, where defined, ``noise_scale`` (tokens)."""
        if self.count == 0:
            return {}
        grad_sq, trace = self.averages()
        out = {"noise_grad_sq": grad_sq, "noise_trace": trace}
        if (scale := simple_noise_scale(trace, grad_sq)) is not None:
            out["noise_scale"] = scale
        return out

    def summary(self) -> dict:
        """The run summary's figures: the last averages and the number of measurements."""
        if self.count == 0:
            return {}
        return {**self.fields(), "noise_scale_measurements": self.count, "noise_scale_unit": "tokens"}

    def state_dict(self) -> dict:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "count": self.count}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.grad_sq, self.trace = float(state.get("grad_sq", 0.0)), float(state.get("trace", 0.0))
        self.count = int(state.get("count", 0))
