"""The distillation losses: Hinton's τ²·KL against a hand-computed case and torch's categorical KL, zero for a
student equal to its teacher, the renormalised top-k form against its closed form and the full KL at k = V,
the generalised JSD against TRL's ``GKDTrainer.generalized_jsd_loss`` on the same logits, and the objectives
(offline on windows and chat rows, on-policy on rollouts with the prompt masked) against those losses."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.distributions import Categorical, kl_divergence
from torch.testing import assert_close

from lmforge.data.packing import IGNORE_INDEX
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.objectives.distill import (
    DistillConfig,
    DistillObjective,
    GKDConfig,
    OnPolicyDistillObjective,
    generalized_jsd,
    kd_loss,
    live_teacher,
    topk_kd_loss,
)
from lmforge.objectives.distill_teacher import topk_cache
from lmforge.objectives.sft import SFTObjective

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.gkd.gkd_trainer import GKDTrainer  # noqa: E402  (a dev dependency: the reference)


def test_kd_loss_is_tau_squared_times_the_kl_of_a_hand_computed_case():
    # the teacher's logits (2 ln 3, 0) at τ = 2 soften to p_T = (3/4, 1/4); the student's (0, 0) are (1/2, 1/2)
    teacher = torch.tensor([[2 * math.log(3.0), 0.0]])
    student = torch.zeros(1, 2)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert kd_loss(student, teacher, 2.0).item() == pytest.approx(4 * kl, rel=1e-6)
    assert kd_loss(student, teacher, 1.0).item() == pytest.approx(
        0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-6)  # τ = 1: softmax(2 ln 3, 0) = (0.9, 0.1)


@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_kd_loss_equals_torch_categorical_kl_and_trl_forward_kl(tau):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(24, 40, generator=g) * 3, torch.randn(24, 40, generator=g) * 3
    expected = tau**2 * kl_divergence(Categorical(logits=teacher / tau), Categorical(logits=student / tau)).sum()
    # float32 sums of 24 x 40 terms of order 1: agreement to a few ulps of the total
    assert_close(kd_loss(student, teacher, tau), expected, rtol=1e-5, atol=1e-6)
    trl = GKDTrainer.generalized_jsd_loss(student[None], teacher[None], beta=0.0, temperature=tau, reduction="sum")
    assert_close(kd_loss(student, teacher, tau), tau**2 * trl, rtol=1e-5, atol=1e-6)


def test_a_student_equal_to_its_teacher_has_zero_kl():
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    assert kd_loss(logits, logits.clone(), 2.0).item() == 0.0
    ids = logits.topk(4, -1).indices
    assert topk_kd_loss(logits, ids, logits.gather(-1, ids), 2.0).item() == 0.0
    for beta in (0.0, 0.5, 1.0):
        assert generalized_jsd(logits, logits.clone(), beta).abs().max().item() < 1e-7


def test_topk_kd_loss_renormalises_over_the_teachers_k_tokens():
    # teacher top 2 of 3: tokens (2, 0) with logits (ln 3, 0) -> p̂_T = (3/4, 1/4); the student's logits of them
    # are (0, ln 3) -> p̂_S = (1/4, 3/4); the student's third logit (100) is outside S and does not count
    student = torch.tensor([[math.log(3.0), 100.0, 0.0]])
    ids, teacher = torch.tensor([[2, 0]]), torch.tensor([[math.log(3.0), 0.0]])
    kl = 0.75 * math.log(0.75 / 0.25) + 0.25 * math.log(0.25 / 0.75)
    assert topk_kd_loss(student, ids, teacher, 1.0).item() == pytest.approx(kl, rel=1e-6)
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    values, order = t.topk(16, -1)  # k = V: the full KL, summed in another order
    assert_close(topk_kd_loss(s, order, values, 1.5), kd_loss(s, t, 1.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trl_gkd_on_the_same_logits(beta, tau):
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(3, 7, 50, generator=g) * 2, torch.randn(3, 7, 50, generator=g) * 2
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[:, :3] = IGNORE_INDEX  # prompt positions
    labels[1, 5:] = IGNORE_INDEX  # padding
    mask = labels != IGNORE_INDEX
    ours = generalized_jsd(student[mask], teacher[mask], beta, tau).sum()
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=tau, reduction="sum")
    # the same float32 operations up to the order of the final sum over 13 positions and 50 entries
    assert_close(ours, trl, rtol=1e-5, atol=1e-6)
    mean = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=tau)
    assert_close(ours / mask.sum(), mean, rtol=1e-5, atol=1e-6)  # TRL's batchmean: per unmasked token


def tiny(seed: int, width: int = 32) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, d_model=width, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_hidden=2 * width, max_seq_len=32))


def test_offline_objective_mixes_the_data_loss_and_the_kl_at_the_target_tokens():
    student, teacher = tiny(0), tiny(1, width=48)  # a teacher of another size
    windows = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(4))
    cfg = DistillConfig(teacher="unused", temperature=2.0, alpha=0.3)
    out = DistillObjective(CausalLMObjective(), cfg, teacher=live_teacher(teacher))(student, windows)
    s, t = student(windows[:, :-1]).flatten(0, 1), teacher(windows[:, :-1]).flatten(0, 1).detach()
    ce = torch.nn.functional.cross_entropy(s, windows[:, 1:].flatten(), reduction="sum")
    assert out.n_targets == 48
    assert_close(out.loss_sum, 0.7 * ce + 0.3 * kd_loss(s, t, 2.0), rtol=1e-5, atol=1e-5)
    assert_close(out.metrics["distill/data_loss"], ce.detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # validation: the data loss alone
        assert_close(DistillObjective(CausalLMObjective(), cfg, teacher=live_teacher(teacher))(student, windows).loss_sum,
                     CausalLMObjective()(student, windows).loss_sum)


def test_offline_objective_on_chat_rows_counts_only_labelled_tokens_and_top_k_of_all_equals_live(tmp_path):
    student, teacher = tiny(0), tiny(1)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    rows = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(12).expand(4, 12).clone()}
    cfg = DistillConfig(teacher="unused", temperature=1.0, alpha=1.0)
    live = DistillObjective(SFTObjective(), cfg, teacher=live_teacher(teacher))(student, rows)
    at = labels[:, 1:] != IGNORE_INDEX
    expected = kd_loss(student(ids)[:, :-1][at], teacher(ids)[:, :-1][at].detach(), 1.0)
    assert live.n_targets == int(at.sum()) == 28
    assert_close(live.loss_sum, expected, rtol=1e-5, atol=1e-5)
    batches = [SFTObjective().inputs({k: v[i : i + 2] for k, v in rows.items()})[:2] for i in (0, 2)]
    cache = topk_cache(tmp_path / "topk.safetensors", teacher, batches, 64, "teacher")
    cached = DistillObjective(SFTObjective(), cfg, topk=cache)(student, {k: v[[3, 0, 2]] for k, v in rows.items()})
    at3 = at[[3, 0, 2]]
    expected3 = kd_loss(student(ids[[3, 0, 2]])[:, :-1][at3], teacher(ids[[3, 0, 2]])[:, :-1][at3].detach(), 1.0)
    assert_close(cached.loss_sum, expected3, rtol=1e-5, atol=1e-5)  # found by content, in any order
    again = topk_cache(tmp_path / "topk.safetensors", tiny(7), batches, 64, "teacher")  # same key: read, not recomputed
    assert torch.equal(again.logits, cache.logits)


def test_on_policy_objective_is_trl_gkd_over_the_response_tokens_only():
    student, teacher = tiny(0), tiny(1, width=48)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 64, (3, 10), generator=g)
    attention = torch.ones(3, 10, dtype=torch.long)
    attention[2, 7:] = 0  # right padding
    loss_mask = torch.zeros(3, 10, dtype=torch.bool)
    loss_mask[:, 4:] = True
    loss_mask &= attention.bool()
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    for beta in (0.0, 0.5, 1.0):
        out = OnPolicyDistillObjective(GKDConfig(beta=beta, temperature=1.5), live_teacher(teacher))(student, batch)
        labels = torch.where(loss_mask, ids, IGNORE_INDEX)[:, 1:]
        trl = GKDTrainer.generalized_jsd_loss(student(ids)[:, :-1], teacher(ids)[:, :-1].detach(), labels=labels,
                                              beta=beta, temperature=1.5, reduction="sum")
        assert out.n_targets == int(loss_mask.sum()) == 15
        assert_close(out.loss_sum, trl, rtol=1e-5, atol=1e-5)
