"""The alignment objectives against TRL 1.x (a test-only dependency) on the same model and data.

DPO's variants and KTO go through TRL's own ``_compute_loss`` on a ``LlamaForCausalLM`` that
holds our model's weights (TRL extracts the log-probs itself with its fused LM head);
SimPO, CPO and ORPO through ``CPOTrainer.cpo_loss``/``ORPOTrainer.odds_ratio_loss`` on
log-probs from TRL's ``get_batch_logps``; the reward model against ``RewardTrainer``'s
loss. Batches are odd-sized, padded right and left, with pad equal to end-of-text.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from lmforge.data.preference import PreferencePair, pair_rows, parse_pair, parse_unpaired, unpaired_rows
from lmforge.model.config import ModelConfig
from lmforge.model.reward import RewardModel
from lmforge.objectives.dpo import PreferenceLossConfig, PreferenceObjective
from lmforge.objectives.kto import KTOLossConfig, KTOObjective
from lmforge.objectives.reward import RewardLossConfig, RewardObjective
from tests.model.test_hf import hf_model, randomized

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# TRL is a dev dependency (the reference these tests compare against), imported unconditionally
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

SYSTEM = {"role": "system", "content": "Answer with the result only."}
RECORDS = [  # three pairs (odd), conversational and plain, of different lengths
    {"prompt": [SYSTEM, {"role": "user", "content": "What is 12 + 30?"}],
     "chosen": [{"role": "assistant", "content": "42"}], "rejected": [{"role": "assistant", "content": "41"}]},
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a city in the south of Spain."},
    {"prompt": [{"role": "user", "content": "Reverse the string 'stone'."}],
     "chosen": [{"role": "assistant", "content": "enots"}],
     "rejected": [{"role": "assistant", "content": "the reversed string is stoen"}]},
]


class Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(m):
        return m


def trainer_self(**attrs) -> SimpleNamespace:
    """The attributes TRL's loss code reads from its trainer, nothing more."""
    base = dict(model=SimpleNamespace(training=True), accelerator=Accelerator(), aux_loss_enabled=False,
                precompute_ref_logps=True, ref_model=None, _metrics=defaultdict(lambda: defaultdict(list)),
                _total_train_tokens=0, _tp_size=1,
                args=SimpleNamespace(discopop_tau=0.05, gradient_checkpointing_kwargs=None))
    return SimpleNamespace(**{**base, **attrs})


@pytest.fixture(scope="module")
def models(small_tokenizer):
    cfg = ModelConfig(vocab_size=small_tokenizer.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=128, max_seq_len=96)
    ours = randomized(cfg).double()
    theirs = hf_model(cfg, ours.state_dict()).double()
    theirs.config._attn_implementation = "sdpa"  # eager turns fully masked (left-padding) rows into NaN
    add_fused_lm_head(theirs, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return ours, theirs


def pairs(tok) -> list[PreferencePair]:
    return [parse_pair(tok, r, 96, "truncate")[0] for r in RECORDS]


def trl_inputs(rows: dict, left: bool) -> dict:
    """TRL's DPO batch: [chosen; rejected] ids, attention and completion masks (and positions for left padding)."""
    ids = torch.cat([rows["chosen_input_ids"], rows["rejected_input_ids"]])
    mask = torch.cat([rows["chosen_attention_mask"], rows["rejected_attention_mask"]])
    labels = torch.cat([rows["chosen_labels"], rows["rejected_labels"]])
    inputs = {"input_ids": ids, "attention_mask": mask, "completion_mask": (labels != -100).long()}
    if left:
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return inputs


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(("loss", "trl_type", "eps", "sft"), [
    ("dpo", "sigmoid", 0.0, 0.0), ("ipo", "ipo", 0.0, 0.0), ("rdpo", "robust", 0.2, 0.0), ("hinge", "hinge", 0.0, 0.0),
    ("dpo", "sigmoid", 0.0, 0.7),  # RPO: TRL's loss_type ["sigmoid", "sft"]
])
def test_dpo_variants_equal_trl_dpo_trainer(models, small_tokenizer, loss, trl_type, eps, sft, side):
    ours, theirs = models
    tok = small_tokenizer
    rows = pair_rows(pairs(tok), pad_id=tok.eos_id, side=side)  # pad == end-of-text
    g = torch.Generator().manual_seed(3)
    rows["ref_chosen_logps"] = -20 * torch.rand(3, generator=g, dtype=torch.float64)
    rows["ref_rejected_logps"] = -20 * torch.rand(3, generator=g, dtype=torch.float64)
    inputs = {**trl_inputs(rows, side == "left"), "ref_chosen_logps": rows["ref_chosen_logps"],
              "ref_rejected_logps": rows["ref_rejected_logps"]}
    types, weights = ([trl_type, "sft"], [1.0, sft]) if sft else ([trl_type], [1.0])
    fake = trainer_self(ld_alpha=None, f_divergence_type="reverse_kl", loss_types=types, loss_weights=weights,
                        beta=0.3, label_smoothing=eps, use_weighting=False)
    expected = DPOTrainer._compute_loss(fake, theirs, inputs, return_outputs=False)
    out = PreferenceObjective(PreferenceLossConfig(loss, beta=0.3, label_smoothing=eps, sft_weight=sft))(ours, rows)
    assert_close(out.loss_sum / out.n_targets, expected, rtol=1e-6, atol=1e-7)  # HF computes RoPE tables in fp32
    metrics = {k: v / out.n_targets for k, v in out.metrics.items()}
    assert metrics["reward_chosen"].item() == pytest.approx(fake._metrics["train"]["rewards/chosen"][0], rel=1e-6)
    assert metrics["margin"].item() == pytest.approx(fake._metrics["train"]["rewards/margins"][0], rel=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(fake._metrics["train"]["rewards/accuracies"][0])


def test_dpo_loss_is_ln2_when_the_policy_is_its_own_reference_and_the_gradient_is_not_zero(models, small_tokenizer):
    from lmforge.objectives.reference import frozen_copy_reference

    ours, _ = models
    rows = pair_rows(pairs(small_tokenizer), pad_id=small_tokenizer.pad_id)
    ours.zero_grad()
    out = PreferenceObjective(PreferenceLossConfig("dpo"), frozen_copy_reference(ours))(ours, rows)
    loss = out.loss_sum / out.n_targets
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    loss.backward()
    assert ours.embed.weight.grad.abs().sum() > 0
    ours.zero_grad()


def trl_logps(model, rows: dict, side: str, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected log-probs of TRL's ``get_batch_logps`` on our model's logits."""
    from lmforge.model.reward import model_inputs

    out = []
    for which in ("chosen", "rejected"):
        ids, mask = rows[f"{which}_input_ids"], rows[f"{which}_attention_mask"]
        logits = model(ids, **model_inputs(ids, mask))
        out.append(CPOTrainer.get_batch_logps(logits, rows[f"{which}_labels"], average_log_prob=average))
    return out[0], out[1]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("loss", ["simpo", "cpo", "orpo"])
def test_reference_free_losses_equal_trl(models, small_tokenizer, loss, side):
    ours, _ = models
    tok = small_tokenizer
    rows = pair_rows(pairs(tok), pad_id=tok.eos_id, side=side)
    cfg = PreferenceLossConfig(loss, beta=0.7, simpo_gamma=0.4, cpo_alpha=0.5 if loss == "cpo" else 1.0)
    out = PreferenceObjective(cfg)(ours, rows)
    got = out.loss_sum / out.n_targets
    with torch.no_grad():
        chosen, rejected = trl_logps(ours, rows, side, average=loss in ("simpo", "orpo"))
        if loss == "orpo":  # NLL over the chosen prompt + completion (trl PR #1516): every real token after BOS
            labels = rows["chosen_input_ids"].masked_fill(rows["chosen_attention_mask"] == 0, -100)
            ids, mask = rows["chosen_input_ids"], rows["chosen_attention_mask"]
            from lmforge.model.reward import model_inputs

            logits = ours(ids, **model_inputs(ids, mask))
            sums = CPOTrainer.get_batch_logps(logits, labels)
            nll = -sums.sum() / (labels[:, 1:] != -100).sum()
            fake = SimpleNamespace(beta=0.7, accelerator=Accelerator())
            ratio_losses = ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)[0]
            expected = nll - ratio_losses.mean()
        else:
            fake = SimpleNamespace(beta=0.7, alpha=0.0, label_smoothing=0.0, simpo_gamma=0.4, accelerator=Accelerator(),
                                   loss_type="simpo" if loss == "simpo" else "sigmoid")
            losses = CPOTrainer.cpo_loss(fake, chosen, rejected)[0]
            expected = losses.mean()
            if loss == "cpo":  # TRL adds cpo_alpha × NLL of the chosen completion tokens
                sums = CPOTrainer.get_batch_logps(ours(rows["chosen_input_ids"], **model_inputs_of(rows, "chosen")),
                                                  rows["chosen_labels"])
                expected = expected + 0.5 * (-sums.sum() / (rows["chosen_labels"][:, 1:] != -100).sum())
    assert_close(got.detach(), expected, rtol=1e-6, atol=1e-7)  # HF computes RoPE tables in fp32


def model_inputs_of(rows: dict, which: str) -> dict:
    from lmforge.model.reward import model_inputs

    return model_inputs(rows[f"{which}_input_ids"], rows[f"{which}_attention_mask"])


KTO_RECORDS = [
    {"prompt": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
     "completion": [{"role": "assistant", "content": "4"}], "label": True},
    {"prompt": "The sky is", "completion": " green and made of cheese.", "label": False},
    {"prompt": [{"role": "user", "content": "Sort 3, 1, 2."}],
     "completion": [{"role": "assistant", "content": "1, 2, 3"}], "label": True},
    {"prompt": "Water boils at", "completion": " 100 degrees Celsius at sea level.", "label": True},
    {"prompt": [{"role": "user", "content": "Reverse 'abc'."}],
     "completion": [{"role": "assistant", "content": "abc"}], "label": False},
]


@pytest.mark.parametrize("side", ["right", "left"])
def test_kto_equals_trl_kto_trainer(models, small_tokenizer, side):
    ours, theirs = models
    tok = small_tokenizer
    examples = [parse_unpaired(tok, r, 96, "truncate")[0] for r in KTO_RECORDS]
    rows = unpaired_rows(examples, pad_id=tok.eos_id, max_length=96, seed=1, side=side)
    g = torch.Generator().manual_seed(5)
    rows["ref_logps"] = -30 * torch.rand(5, generator=g, dtype=torch.float64)
    rows["ref_kl_logps"] = -30 * torch.rand(5, generator=g, dtype=torch.float64)
    inputs = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"],
              "completion_mask": (rows["labels"] != -100).long(), "label": rows["desirable"],
              "KL_input_ids": rows["kl_input_ids"], "KL_attention_mask": rows["kl_attention_mask"],
              "KL_completion_mask": (rows["kl_labels"] != -100).long(),
              "ref_logps": rows["ref_logps"], "ref_KL_logps": rows["ref_kl_logps"]}
    fake = trainer_self(beta=0.2, desirable_weight=1.3, undesirable_weight=0.8, loss_type="kto", calculate_KL=True)
    fake._compute_kl_logps = MethodType(KTOTrainer._compute_kl_logps, fake)
    if side == "left":  # TRL passes extra model kwargs through: positions make left padding exact
        inputs["position_ids"] = (rows["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        kl_positions = (rows["kl_attention_mask"].cumsum(-1) - 1).clamp(min=0)

        def kl_logps(self, model, batch):  # the KL rows have their own padding, so their own positions
            return KTOTrainer._compute_kl_logps(self, model, {**batch, "position_ids": kl_positions})

        fake._compute_kl_logps = MethodType(kl_logps, fake)
    loss = KTOTrainer._compute_loss(fake, theirs, inputs, return_outputs=False)
    out = KTOObjective(KTOLossConfig(beta=0.2, desirable_weight=1.3, undesirable_weight=0.8))(ours, rows)
    assert_close(out.loss_sum / out.n_targets, loss, rtol=1e-6, atol=1e-7)  # HF computes RoPE tables in fp32
    assert (out.metrics["kl"] / out.n_targets).item() == pytest.approx(fake._metrics["train"]["kl"][0], rel=1e-6)


def test_kto_with_reward_equal_to_the_baseline_gives_half_of_each_weight():
    from lmforge.objectives.preference import kto_loss

    r = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    losses, _, z0 = kto_loss(r, torch.zeros(3, dtype=torch.float64), torch.tensor([True, False, True]),
                             torch.full((3,), 0.5, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                             beta=0.1, lambda_d=2.0, lambda_u=0.5)
    assert z0.item() == pytest.approx(0.5)
    assert losses.tolist() == pytest.approx([1.0, 0.25, 1.0])


@pytest.mark.parametrize("center", [0.0, 0.01])
def test_reward_loss_equals_trl_reward_trainer(models, small_tokenizer, center):
    from trl.trainer.reward_trainer import RewardTrainer

    ours, _ = models
    tok = small_tokenizer
    ps = pairs(tok)
    for p, m in zip(ps, (0.5, 0.0, 1.5)):
        p.margin = m
    rows = pair_rows(ps, pad_id=tok.eos_id)
    model = RewardModel(ours).double()
    out = RewardObjective(RewardLossConfig(center_coef=center))(model, rows)
    with torch.no_grad():
        chosen = model(rows["chosen_input_ids"], rows["chosen_attention_mask"])
        rejected = model(rows["rejected_input_ids"], rows["rejected_attention_mask"])

    class Scores(torch.nn.Module):  # RewardTrainer reads logits of chosen then rejected rows
        def forward(self, input_ids, attention_mask, **_):
            return SimpleNamespace(logits=torch.cat([chosen, rejected])[:, None])

    fake = trainer_self(args=SimpleNamespace(center_rewards_coefficient=center or None))
    inputs = {"input_ids": torch.cat([rows["chosen_input_ids"], rows["rejected_input_ids"]]),
              "attention_mask": torch.cat([rows["chosen_attention_mask"], rows["rejected_attention_mask"]]),
              "margin": rows["margin"].double()}
    expected = RewardTrainer.compute_loss(fake, Scores(), inputs)
    assert_close((out.loss_sum / out.n_targets).detach(), expected, rtol=1e-6, atol=1e-7)  # HF computes RoPE tables in fp32

