"""DoReMi's proxy objective (lmforge.objectives.doremi)."""

import pytest
import torch

from lmforge.data.doremi import domain_excess_losses, exponentiated_gradient_step
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.doremi import DoReMiConfig, DoReMiObjective, dro_weighted_loss, token_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def test_weighted_loss_with_the_batch_shares_as_sampling_is_the_closed_form():
    torch.manual_seed(0)
    losses = torch.rand(5, 4, dtype=torch.float64)
    domains = torch.tensor([0, 2, 0, 1, 0])
    weights = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    shares = torch.tensor([3 / 5, 1 / 5, 1 / 5], dtype=torch.float64)  # each domain's share of the batch's tokens
    means = [losses[domains == i].mean() for i in range(3)]  # ℓ̄_i
    closed = sum(w * m for w, m in zip(weights, means))  # L(θ, α) = Σ_i α_i ℓ̄_i
    assert float(dro_weighted_loss(losses, domains, weights, shares) / losses.numel()) == pytest.approx(
        float(closed), rel=1e-12)
    # any sampling: Σ_t α_d(t) / s_d(t) · ℓ_t, token by token
    sampling = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    by_token = sum(float(weights[d] / sampling[d]) * float(losses[r].sum()) for r, d in enumerate(domains.tolist()))
    assert float(dro_weighted_loss(losses, domains, weights, sampling)) == pytest.approx(by_token, rel=1e-12)


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16))


def test_a_training_batch_updates_the_weights_first_then_trains_under_them():
    proxy, reference = _model(0), _model(1)
    cfg = DoReMiConfig(step_size=1.0, smoothing=1e-3)
    objective = DoReMiObjective(reference, ["a", "b", "c"], [1.0, 1.0, 2.0], cfg)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    domains = torch.tensor([0, 2, 2, 1])
    out = objective(proxy, {"input_ids": ids, "domains": domains})

    with torch.no_grad():
        ell = token_losses(proxy(ids[:, :-1]), ids[:, 1:]).double()
        ref = token_losses(reference(ids[:, :-1]), ids[:, 1:]).double()
    lam = domain_excess_losses(ell - ref, domains, 3, torch.zeros(3, dtype=torch.float64))
    alpha = exponentiated_gradient_step(torch.full((3,), 1 / 3, dtype=torch.float64), lam, 1.0, 1e-3)
    assert objective.weights.tolist() == pytest.approx(alpha.tolist(), abs=1e-6)  # λ from float32 differences
    assert objective.domain_weights() == pytest.approx(dict(zip("abc", alpha.tolist())), abs=1e-6)  # ᾱ of 1 update
    sampling = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    expected = sum(float(alpha[d] / sampling[d]) * float(ell[r].sum()) for r, d in enumerate(domains.tolist()))
    assert float(out.loss_sum.detach()) == pytest.approx(expected, rel=1e-5)  # float32 losses
    assert out.n_targets == 32 and out.loss_sum.requires_grad
    assert float(out.metrics["doremi/weight/b"]) / 32 == pytest.approx(float(alpha[1]), rel=1e-6)


def test_the_mean_weights_average_every_update_and_validation_leaves_them():
    objective = DoReMiObjective(_model(1), ["a", "b"], [1.0, 1.0], DoReMiConfig())
    proxy = _model(0)
    seen = []
    for seed in range(3):
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
        objective(proxy, {"input_ids": ids, "domains": torch.tensor([0, 1])})
        seen.append(objective.weights.clone())
    assert objective.average.tolist() == pytest.approx(torch.stack(seen).mean(0).tolist(), abs=1e-15)
    with torch.no_grad():
        plain = objective(proxy, torch.randint(0, 64, (2, 9)))  # a validation window: the plain loss
    assert objective.updates == 3 and not plain.metrics
    state = objective.state_dict()
    again = DoReMiObjective(_model(1), ["a", "b"], [1.0, 1.0], DoReMiConfig())
    again.load_state_dict(state)
    assert again.state_dict() == state
