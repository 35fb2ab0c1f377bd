"""Rollout/trainer mismatch correction: the weights of each mode on a hand-computed case (verl's
and TRL's token formulas, the geometric sequence ratio), TRL's own loss with the weight, the
weight exactly 1 when the trainer's and the engine's log-probs agree, what a fp32 engine and
trainer give end to end on a tiny model, the batch source's columns per ``rl.old_logprobs``, and
bad keys refused as one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.rl.correction import RLConfig, rollout_correction_weights
from lmforge.rl.losses import PolicyLossConfig, policy_loss
from lmforge.rl.objective import PolicyObjective, token_logprobs
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import Scores
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import GRPOConfig, RolloutBatches, reference_policy
from lmforge.stages.grpo import GRPORecipe
from tests.rl.references import trl_grpo_loss

pytestmark = pytest.mark.usefixtures("one_thread")

# token ratios ρ = π_old / π_rollout of four responses (0: padding), C = 2
RATIOS = [[1.0, 3.0, 0.25, 1.5], [0.6, 2.5, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0], [0.3, 0.4, 0.0, 0.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
# the geometric means of each row's ratios: 1.125^(1/4), 1.5^(1/2), 12^(1/2), 0.12^(1/2)
GEOMETRIC = [1.0298835719535588, 1.2247448713915890, 3.4641016151377544, 0.3464101615137755]


def case() -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_old, log π_rollout) with the ratios above: the rollout's log-probs are arbitrary."""
    rollout = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) - 0.5
    log_rho = torch.tensor([[math.log(r) if r else 0.0 for r in row] for row in RATIOS])
    return rollout + log_rho, rollout


def padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows) * MASK


EXPECTED = {
    # verl's TIS (rollout_is="token": clamp(max=C)) = TRL's token_truncate (clip_max C, no clip_min)
    "token_truncate": padded([[1.0, 2.0, 0.25, 1.5], [0.6, 2.0, 0, 0], [2.0, 2.0, 0, 0], [0.3, 0.4, 0, 0]]),
    # TRL's token_mask with clip_min 1/C, clip_max C (verl's token_k1 bounds): out-of-band ratios to 0
    "token_mask": padded([[1.0, 0.0, 0.0, 1.5], [0.6, 0.0, 0, 0], [0.0, 0.0, 0, 0], [0.0, 0.0, 0, 0]]),
    "sequence_truncate": padded([[GEOMETRIC[0]] * 4, [GEOMETRIC[1]] * 2 + [0, 0], [2.0, 2.0, 0, 0],
                                 [GEOMETRIC[3]] * 2 + [0, 0]]),
    "sequence_mask": padded([[GEOMETRIC[0]] * 4, [GEOMETRIC[1]] * 2 + [0, 0], [0.0, 0.0, 0, 0], [0.0, 0.0, 0, 0]]),
}
# tokens truncated or masked, of the 10 response tokens
CORRECTED = {"token_truncate": 4, "token_mask": 7, "sequence_truncate": 2, "sequence_mask": 4}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_the_weights_are_verls_and_trls_formulas_on_a_hand_computed_case(mode):
    old, rollout = case()
    weights, figures = rollout_correction_weights(old, rollout, MASK, mode, cap=2.0)
    # float32 log/exp of ratios of order 1: a relative error of a few ulp (1e-7 each)
    assert torch.allclose(weights, EXPECTED[mode], rtol=1e-6, atol=0)
    assert float(figures["rollout_corrected_share"]) == pytest.approx(CORRECTED[mode] / 10, abs=1e-7)
    level = GEOMETRIC if mode.startswith("sequence") else None
    ratios = [r for row in RATIOS for r in row if r] if level is None else \
        [g for g, row in zip(GEOMETRIC, RATIOS) for r in row if r]
    assert float(figures["rollout_ratio_mean"]) == pytest.approx(sum(ratios) / 10, rel=1e-6)
    assert float(figures["rollout_ratio_max"]) == pytest.approx(max(ratios), rel=1e-6)
    assert float(figures["rollout_weight_mean"]) == pytest.approx(float(EXPECTED[mode].sum()) / 10, rel=1e-6)
    k3 = sum(r - 1 - math.log(r) for row in RATIOS for r in row if r) / 10  # verl's rollout_corr/k3_kl
    assert float(figures["rollout_kl"]) == pytest.approx(k3, rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_weighted_loss_equals_trls_loss_with_its_importance_sampling_ratio(beta):
    old, rollout = case()
    torch.manual_seed(1)
    logp = (old + 0.2 * torch.randn(4, 4)).requires_grad_()
    adv, ref = torch.randn(4), old - 0.1 * torch.rand(4, 4)
    weights, _ = rollout_correction_weights(old, rollout, MASK, "token_truncate", cap=2.0)
    cfg = PolicyLossConfig(clip_low=0.2, kl_coef=beta, aggregation="token-mean")
    ours, _ = policy_loss(logp, old, adv, MASK, cfg, ref_logp=ref, weights=weights)
    theirs, _ = trl_grpo_loss(logp, old, adv, MASK, loss_type="bnpo", beta=beta, ref_logp=ref,
                              importance_sampling_ratio=weights)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    g_ours, g_theirs = (torch.autograd.grad(x, logp)[0] for x in (ours, theirs))
    assert torch.allclose(g_ours, g_theirs, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_equal_log_probs_give_a_weight_of_exactly_one_and_the_uncorrected_loss(mode):
    old, _ = case()
    weights, figures = rollout_correction_weights(old, old.clone(), MASK, mode, cap=2.0)
    assert torch.equal(weights, MASK.float())
    assert float(figures["rollout_corrected_share"]) == 0 and float(figures["rollout_kl"]) == 0
    logp, adv = old + 0.1, torch.randn(4)
    assert torch.equal(policy_loss(logp, old, adv, MASK, weights=weights)[0], policy_loss(logp, old, adv, MASK)[0])


# ---------------------------------------------------------------------------------------- end to end

STOPS = list(range(5, 45))  # a random model stops within a few tokens


class LengthReward:
    def __call__(self, rollouts):
        lengths = [float(len(r.response_ids)) for r in rollouts]
        return Scores([v / 10 for v in lengths], {"length": lengths})


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))


@pytest.fixture()
def prompts(small_tokenizer) -> list[Prompt]:
    texts = ["To be, or not", "Once upon a time there", "ROMEO.", "The quick brown fox", "Friends, Romans"]
    return [Prompt([small_tokenizer.bos_id, *small_tokenizer.encode(t)], f"p.jsonl:{i + 1}", t, {"i": i})
            for i, t in enumerate(texts)]


def first_step(model, tok, prompts, rl: RLConfig, precision: str = "fp32") -> list[dict]:
    rollout = RolloutConfig(n=4, max_new_tokens=10, stop_token_ids=STOPS, seed=1)
    source = RolloutBatches(model, tok, prompts, rollout, GRPOConfig(prompts_per_step=2), PolicyLossConfig(),
                            LengthReward(), 3, precision=precision, correction=rl)
    return [next(source) for _ in range(source.grad_accum)]


def test_fp32_engine_and_trainer_log_probs_agree_to_float_rounding_and_the_weight_is_one(model, small_tokenizer,
                                                                                          prompts):
    """The engine decodes a token at a time with a KV cache, the trainer runs the whole row at once:
    the same arithmetic in other matmul shapes, so the log-probs agree to fp32 rounding (not bit for
    bit: some differ by an ulp or so), the weights are 1 to 1e-5 and nothing is truncated or masked."""
    rl = RLConfig(rollout_correction="token_truncate")
    micro = first_step(model, small_tokenizer, prompts, rl)
    objective = PolicyObjective(PolicyLossConfig(), correction=rl)
    tokens = 0
    for mb in micro:
        mask = mb["loss_mask"][:, 1:].bool()
        delta = (mb["old_logprobs"] - mb["rollout_logprobs"])[:, 1:][mask]
        assert float(delta.abs().max()) < 1e-5
        with torch.no_grad():
            logp, _ = token_logprobs(model, mb["input_ids"], mb["attention_mask"], at=mb["loss_mask"].bool())
            out = objective(model, mb)
        assert torch.equal(logp[mask], mb["old_logprobs"][:, 1:][mask])  # the recompute is the objective's forward
        n = int(mask.sum())
        assert float(out.metrics["rollout_corrected_share"]) == 0
        assert abs(float(out.metrics["rollout_weight_mean"]) / n - 1) < 1e-5
        assert abs(float(out.maxima["rollout_ratio_max"]) - 1) < 1e-5
        tokens += n
    assert tokens > 8


def test_without_a_correction_the_batch_and_the_loss_are_todays(model, small_tokenizer, prompts):
    """``none`` (the default): no engine column, the engine's log-probs are π_old in fp32, and the
    objective given the config computes exactly what it computes without it."""
    micro = first_step(model, small_tokenizer, prompts, RLConfig())
    assert all("rollout_logprobs" not in mb for mb in micro)
    for mb in micro:
        a = PolicyObjective(PolicyLossConfig())(model, mb)
        b = PolicyObjective(PolicyLossConfig(), correction=RLConfig())(model, mb)
        assert torch.equal(a.loss_sum, b.loss_sum) and set(a.metrics) == set(b.metrics)


def test_engine_old_logprobs_skip_the_recompute_and_give_weight_one(model, small_tokenizer, prompts, monkeypatch):
    """``rl.old_logprobs: engine`` (verl's bypass mode) runs no scoring forward off fp32 either:
    π_old is the engine's, so the weight is exactly 1 and the ratio is against the engine's."""
    import lmforge.rl.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer, "_scored", lambda *a: calls.append(1))
    rl = RLConfig(rollout_correction="token_mask", old_logprobs="engine")
    micro = first_step(model, small_tokenizer, prompts, rl, precision="bf16")
    assert not calls
    for mb in micro:
        assert torch.equal(mb["old_logprobs"], mb["rollout_logprobs"])
        mask = mb["loss_mask"][:, 1:].bool()
        weights, _ = rollout_correction_weights(mb["old_logprobs"][:, 1:], mb["rollout_logprobs"][:, 1:], mask,
                                                rl.rollout_correction, rl.rollout_correction_cap)
        assert torch.equal(weights, mask.float())


def test_bf16_trainer_against_the_fp32_engine_is_corrected(model, small_tokenizer, prompts):
    """Off fp32 the recomputed π_old (bf16 autocast) differs from the engine's fp32 log-probs: the
    logged largest ratio is that of the two columns, and a cap below it truncates."""
    micro = first_step(model, small_tokenizer, prompts, RLConfig(rollout_correction="token_truncate"), "bf16")
    deltas = torch.cat([(mb["old_logprobs"] - mb["rollout_logprobs"])[:, 1:][mb["loss_mask"][:, 1:].bool()]
                        for mb in micro])
    assert float(deltas.abs().max()) > 1e-4  # bf16's 8-bit mantissa: far above fp32 rounding (1e-7)
    rl = RLConfig(rollout_correction="token_truncate", rollout_correction_cap=math.exp(float(deltas.max()) / 2))
    objective = PolicyObjective(PolicyLossConfig(), correction=rl)
    with torch.no_grad():
        outs = [objective(model, mb) for mb in micro]
    assert max(float(o.maxima["rollout_ratio_max"]) for o in outs) == pytest.approx(math.exp(float(deltas.max())),
                                                                                 rel=1e-6)
    assert sum(float(o.metrics["rollout_corrected_share"]) for o in outs) > 0


@pytest.mark.parametrize("override, message", [
    ("rl.rollout_correction_cap=1.0", "rl.rollout_correction_cap"),
    ("rl.rollout_correction_cap=0.5", "rl.rollout_correction_cap"),
    ("rl.rollout_correction=truncate", "rl.rollout_correction"),
    ("rl.old_logprobs=vllm", "rl.old_logprobs"),
])
def test_a_bad_key_is_one_line_naming_it_and_exit_2(tmp_path, capsys, override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(GRPORecipe, None, [override])
    code = main(["grpo", "recipes/demo/grpo.yaml", f"run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_bad_mode_in_python_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="rl.rollout_correction must be one of none, token_truncate"):
        RLConfig(rollout_correction="tis")
    with pytest.raises(ValueError, match="cap must be > 1"):
        rollout_correction_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token_mask", 1.0)


def test_ppo_batches_and_its_actor_critic_loss_carry_the_correction(small_tokenizer, prompts):
    from lmforge.model.value import ValueModel
    from lmforge.rl.critic import ActorCritic
    from lmforge.rl.ppo import PPOAdvantages, PPOConfig
    from lmforge.stages.ppo import scored_values

    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    torch.manual_seed(0)
    model = ActorCritic(Transformer(cfg), ValueModel(Transformer(cfg)))
    rl = RLConfig(rollout_correction="sequence_truncate")
    ppo = PPOConfig(prompts_per_step=3, kl_coef=0.1)
    source = RolloutBatches(model.backbone, small_tokenizer, prompts, RolloutConfig(n=2, max_new_tokens=10,
                            stop_token_ids=STOPS, seed=1), ppo, PolicyLossConfig(), LengthReward(), 4,
                            precision="bf16", estimate=PPOAdvantages(ppo), correction=rl,
                            reference=reference_policy(model.backbone),
                            critic=lambda ids, mask, at: scored_values(model, ids, mask))
    objective = PolicyObjective(PolicyLossConfig(), vf_coef=0.1, correction=rl)
    for mb in [next(source) for _ in range(source.grad_accum)]:
        mask = mb["loss_mask"][:, 1:].bool()
        assert not torch.equal(mb["old_logprobs"][:, 1:][mask], mb["rollout_logprobs"][:, 1:][mask])  # bf16 vs fp32
        out = objective(model, mb)
        assert torch.isfinite(out.loss_sum) and {"value_loss", "rollout_kl", "rollout_weight_mean"} <= set(out.metrics)
        assert float(out.metrics["rollout_kl"]) > 0
