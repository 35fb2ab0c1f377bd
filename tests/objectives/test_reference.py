"""The reference model: a frozen copy, the policy with adapters disabled, or the untrained policy itself."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from lmforge.data.preference import pair_rows, parse_pair
from lmforge.model.config import ModelConfig
from lmforge.objectives.reference import frozen_copy_reference, precompute_logprobs, untrained_policy_reference
from tests.model.test_hf import randomized

RECORDS = [{"prompt": "The answer is ", "chosen": "the king", "rejected": "42"},
           {"prompt": "Once upon a time", "chosen": " there was a cat.", "rejected": " no."},
           {"prompt": "Q", "chosen": " yes", "rejected": " no, not at all"}]


@pytest.mark.parametrize("side", ["right", "left"])
def test_untrained_policy_scores_like_a_frozen_copy_without_copying_the_model(small_tokenizer, monkeypatch, side):
    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64)
    model = randomized(cfg).train()
    rows = pair_rows([parse_pair(tok, r, 64, "error")[0] for r in RECORDS], tok.pad_id, side=side)
    device = torch.device("cpu")
    expected = {p: precompute_logprobs(frozen_copy_reference(model), rows, p, 2, device, nullcontext)
                for p in ("chosen_", "rejected_")}

    def no_copy(*args, **kwargs):
        raise AssertionError("precomputing the reference must not copy the model")

    monkeypatch.setattr(copy, "deepcopy", no_copy)
    n_params = len(list(model.parameters()))
    for prefix, logps in expected.items():
        got = precompute_logprobs(untrained_policy_reference(model), rows, prefix, 2, device, nullcontext)
        assert torch.equal(got, logps) and torch.isfinite(got).all() and (got < 0).all()
    assert model.training  # scored in eval mode, then put back
    assert len(list(model.parameters())) == n_params and all(p.grad is None for p in model.parameters())


def padded_for_two_ranks(rows: dict[str, torch.Tensor], batch_size: int) -> dict[str, torch.Tensor]:
    """The validation rows as two data-parallel ranks read them (filler included), back in one batch."""
    from lmforge.train.finetune import validation_batches

    shares = [list(validation_batches(rows, batch_size, rank, 2)()) for rank in range(2)]
    return {key: torch.cat([b[key] for share in shares for b in share]) for key in rows}


@pytest.mark.parametrize("loss", ["dpo", "ipo", "orpo", "cpo", "simpo"])
def test_filler_pairs_that_pad_a_distributed_validation_set_weigh_zero(small_tokenizer, loss):
    """The target-free copies ``validation_batches`` adds to make whole global batches change
    nothing: the objective over the real pairs plus filler equals it over the real pairs alone."""
    from lmforge.objectives.dpo import PreferenceLossConfig, PreferenceObjective

    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64)
    model = randomized(cfg).eval()
    rows = pair_rows([parse_pair(tok, r, 64, "error")[0] for r in RECORDS], tok.pad_id)
    generator = torch.Generator().manual_seed(0)
    rows["ref_chosen_logps"] = -10 * torch.rand(3, generator=generator)  # a reference other than the policy
    rows["ref_rejected_logps"] = -10 * torch.rand(3, generator=generator)
    padded = padded_for_two_ranks(rows, 2)  # 3 pairs over 2 ranks x 2 rows: one filler pair
    assert len(padded["chosen_input_ids"]) == 4
    objective = PreferenceObjective(PreferenceLossConfig(loss=loss, sft_weight=0.5 if loss == "dpo" else 0.0))
    with torch.no_grad():
        alone, with_filler = objective(model, rows), objective(model, padded)
    assert objective.num_targets(padded) == with_filler.n_targets == alone.n_targets == 3
    assert with_filler.loss_sum.item() == pytest.approx(alone.loss_sum.item(), rel=1e-5)
    assert with_filler.metrics.keys() == alone.metrics.keys()
    for name, value in alone.metrics.items():
        assert with_filler.metrics[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name


def test_filler_rows_that_pad_a_distributed_kto_validation_set_weigh_zero(small_tokenizer):
    """As for pairs: KTO's loss, baseline z0 and metrics over real rows plus target-free filler
    equal those over the real rows alone."""
    from lmforge.data.preference import parse_unpaired, unpaired_rows
    from lmforge.objectives.kto import KTOLossConfig, KTOObjective

    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64)
    model = randomized(cfg).eval()
    records = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
               for r in RECORDS for side in ("chosen", "rejected")][:5]
    rows = unpaired_rows([parse_unpaired(tok, r, 64, "error")[0] for r in records], tok.pad_id, 64)
    generator = torch.Generator().manual_seed(0)
    rows["ref_logps"] = -10 * torch.rand(5, generator=generator)
    rows["ref_kl_logps"] = -200 - 20 * torch.rand(5, generator=generator)  # z0 > 0: the baseline counts
    padded = padded_for_two_ranks(rows, 3)  # 5 rows over 2 ranks x 3: one filler row
    assert len(padded["input_ids"]) == 6
    objective = KTOObjective(KTOLossConfig(beta=0.02))
    with torch.no_grad():
        alone, with_filler = objective(model, rows), objective(model, padded)
    assert objective.num_targets(padded) == with_filler.n_targets == alone.n_targets == 5
    assert alone.metrics["kl"].item() > 0
    assert with_filler.loss_sum.item() == pytest.approx(alone.loss_sum.item(), rel=1e-5)
    for name, value in alone.metrics.items():
        assert with_filler.metrics[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name


def test_filler_pairs_that_pad_a_distributed_reward_validation_set_weigh_zero(small_tokenizer):
    from lmforge.model.reward import RewardModel
    from lmforge.objectives.reward import RewardLossConfig, RewardObjective

    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64)
    torch.manual_seed(0)
    model = RewardModel(randomized(cfg)).eval()
    rows = pair_rows([parse_pair(tok, r, 64, "error")[0] for r in RECORDS], tok.pad_id)
    padded = padded_for_two_ranks(rows, 2)  # 3 pairs over 2 ranks x 2: one filler pair
    objective = RewardObjective(RewardLossConfig(center_coef=0.01))
    with torch.no_grad():
        alone, with_filler = objective(model, rows), objective(model, padded)
    assert objective.num_targets(padded) == with_filler.n_targets == alone.n_targets == 3
    assert with_filler.loss_sum.item() == pytest.approx(alone.loss_sum.item(), rel=1e-5)
    for name, value in alone.metrics.items():
        assert with_filler.metrics[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name
