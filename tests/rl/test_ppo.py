"""PPO's rollout batch and actor-critic loss: the first epoch has ratio 1 on every token, the
batch's advantages and returns are ``rl.kl``'s KL-shaped rewards through ``rl.advantages``' GAE
and whitening, the loop's summed micro-batches equal ``policy_loss + vf_coef · value_loss`` on
the whole batch, minibatches split a pass into steps, and the value head's shapes and gradients
(shared trunk vs a critic of its own)."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.model.value import ValueModel
from lmforge.rl.advantages import gae, whiten
from lmforge.rl.critic import ActorCritic
from lmforge.rl.kl import kl_shaped_rewards
from lmforge.rl.losses import PolicyLossConfig, entropy_from_logits, policy_loss, value_loss
from lmforge.rl.objective import PolicyObjective, logprobs_of, token_logprobs
from lmforge.rl.ppo import PPOAdvantages, PPOConfig, explained_variance
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import RolloutBatches, reference_policy
from lmforge.stages.ppo import scored_values
from tests.rl.test_trainer import STOPS, LengthReward, prompts, step_batches, whole  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin

CFG = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def tiny(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG)


@pytest.fixture(params=["separate", "shared"])
def actor_critic(request) -> ActorCritic:
    model = ActorCritic(tiny(0), ValueModel(tiny(1)) if request.param == "separate" else None)
    with torch.no_grad():  # a value head that is not all zero
        head = model.critic.value if model.critic is not None else model.value
        head.weight.normal_(0, 0.3)
    return model


def source(model: ActorCritic, tok, prompts, **ppo) -> RolloutBatches:  # noqa: F811
    rollout = RolloutConfig(n=2, max_new_tokens=10, stop_token_ids=STOPS, seed=1)
    cfg = PPOConfig(prompts_per_step=3, kl_coef=0.1, **ppo)
    frozen = tiny(0)  # the base, as the policy starts
    return RolloutBatches(model.backbone, tok, prompts, rollout, cfg, PolicyLossConfig(), LengthReward(), 4,
                          reference=reference_policy(model.backbone, frozen), estimate=PPOAdvantages(cfg),
                          critic=lambda ids, mask, at: scored_values(model, ids, mask))


def test_the_first_epoch_has_ratio_one_on_every_token(actor_critic, small_tokenizer, prompts):  # noqa: F811
    batches = source(actor_critic, small_tokenizer, prompts)
    objective = PolicyObjective(batches.loss, vf_coef=0.1)
    n_tokens = 0
    for mb in step_batches(batches):
        with torch.no_grad():
            out = objective(actor_critic, mb)
            logp, _ = token_logprobs(actor_critic, mb["input_ids"], mb["attention_mask"])
        mask = mb["loss_mask"][:, 1:].bool()
        assert float((torch.exp(logp - mb["old_logprobs"][:, 1:])[mask] - 1).abs().max()) < 1e-5
        assert abs(float(out.maxima["ratio_max"]) - 1) < 1e-5
        n_tokens += int(mask.sum())
    assert n_tokens > 8


def test_the_advantages_are_kl_shaped_rewards_through_gae_and_whitening(actor_critic, small_tokenizer,
                                                                        prompts):  # noqa: F811
    batches = source(actor_critic, small_tokenizer, prompts, gamma=0.9, lam=0.8)
    b = whole(step_batches(batches))
    mask = b["loss_mask"]
    with torch.no_grad():
        ref = torch.cat([torch.zeros(len(mask), 1), token_logprobs(tiny(0), b["input_ids"], b["attention_mask"])[0]], 1)
        values = torch.cat([torch.zeros(len(mask), 1), actor_critic.values(b["input_ids"], b["attention_mask"])[:, :-1]], 1)
    scores = torch.tensor([float(n) / 10 for n in mask.sum(-1).tolist()])  # LengthReward on the responses
    rewards, kl = kl_shaped_rewards(scores, b["old_logprobs"], ref * mask, mask, 0.1, "k1")
    advantages, returns = gae(rewards, values * mask, mask, 0.9, 0.8)
    assert torch.allclose(b["old_values"], values * mask, atol=1e-6)
    assert torch.allclose(b["returns"], returns, atol=1e-5)
    assert torch.allclose(b["advantages"], whiten(advantages, mask), atol=1e-4)
    stats = {k.removeprefix("stat_"): float(v[0]) for k, v in step_batches(batches)[0].items() if k.startswith("stat_")}
    assert stats["kl"] == pytest.approx(float(kl.sum(-1).mean()), abs=1e-5)
    assert stats["explained_variance"] == pytest.approx(explained_variance(values * mask, returns, mask), abs=1e-5)


def test_the_loops_sum_over_micro_batches_is_the_ppo_loss_on_the_whole_batch(actor_critic, small_tokenizer,
                                                                             prompts):  # noqa: F811
    loss_cfg = PolicyLossConfig(clip_low=0.1, clip_high=0.2, entropy_coef=0.01)
    batches = source(actor_critic, small_tokenizer, prompts)
    micro = step_batches(batches)
    with torch.no_grad():  # move off-policy, so the clipping of ratios and values matters
        for p in actor_critic.parameters():
            p.add_(0.05 * torch.randn_like(p))
    objective = PolicyObjective(loss_cfg, vf_coef=0.5, value_clip=0.05)
    n_targets = sum(objective.num_targets(mb) for mb in micro)
    ours = sum(objective(actor_critic, mb).loss_sum for mb in micro) / n_targets
    params = [p for p in actor_critic.parameters() if p.requires_grad]
    grad_ours = torch.autograd.grad(ours, params)

    b = whole(micro)
    logits, values = actor_critic.logits_and_values(b["input_ids"], b["attention_mask"])
    logits, values, mask = logits[:, :-1], values[:, :-1], b["loss_mask"][:, 1:]
    p_loss, _ = policy_loss(logprobs_of(logits, b["input_ids"]), b["old_logprobs"][:, 1:], b["advantages"][:, 1:],
                            mask, loss_cfg, entropy=entropy_from_logits(logits))
    v_loss, v_metrics = value_loss(values, b["old_values"][:, 1:], b["returns"][:, 1:], mask, clip=0.05)
    theirs = p_loss + 0.5 * v_loss
    grad_theirs = torch.autograd.grad(theirs, params)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-6)
    assert all(torch.allclose(a, c, atol=1e-6, rtol=1e-4) for a, c in zip(grad_ours, grad_theirs))
    outs = [objective(actor_critic, mb) for mb in micro]
    assert float(sum(o.metrics["value_loss"] for o in outs) / n_targets) == pytest.approx(float(v_loss.detach()), rel=1e-5)
    assert float(v_metrics["value_clip_frac"]) > 0


def test_minibatches_split_each_pass_and_epochs_reuse_the_batch(actor_critic, small_tokenizer,
                                                                prompts):  # noqa: F811
    batches = source(actor_critic, small_tokenizer, prompts, minibatches=3, updates_per_batch=2)
    assert batches.grad_accum == 1  # 6 rows in 3 minibatches of 2 rows, micro-batches of 4
    steps = [step_batches(batches)[0] for _ in range(6)]
    assert [len(s["input_ids"]) for s in steps] == [2] * 6 and batches.state.cursor == 3
    assert all(steps[i] is steps[i + 3] for i in range(3))  # the second epoch: the same rows again
    fresh = step_batches(batches)[0]
    assert batches.state.groups == 6 and fresh is not steps[0]  # a third step of a pass: a new rollout batch


def test_the_value_head_gives_one_value_per_token_and_its_gradient_reaches_only_its_critic():
    separate = ActorCritic(tiny(0), ValueModel(tiny(1)))
    shared = ActorCritic(tiny(0))
    ids = torch.randint(0, 512, (3, 7))
    for model in (separate, shared):
        logits, values = model.logits_and_values(ids)
        assert logits.shape == (3, 7, 512) and values.shape == (3, 7) and values.dtype == torch.float32
        assert torch.equal(model(ids), logits) and torch.equal(model.values(ids), values)
    assert float(shared.values(ids).detach().abs().max()) == 0  # a fresh head values every state at 0
    policy = list(separate.backbone.parameters())
    grads = torch.autograd.grad(separate.logits_and_values(ids)[1].sum(), policy + [separate.critic.value.weight],
                                allow_unused=True)
    assert all(g is None for g in grads[:-1]) and grads[-1] is not None  # the policy never feels the value loss
    with torch.no_grad():
        shared.value.weight.normal_()
    grads = torch.autograd.grad(shared.logits_and_values(ids)[1].sum(), [shared.backbone.embed.weight,
                                                                          shared.value.weight])
    assert all(float(g.abs().sum()) > 0 for g in grads)  # a shared trunk learns from the critic's loss
    assert {n.split(".")[0] for n, _ in separate.named_parameters()} == {"backbone", "critic"}
    assert {n.split(".")[0] for n, _ in shared.named_parameters()} == {"backbone", "value"}


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_a_constant():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 5.0), returns, mask) == pytest.approx(0.0)


def test_the_value_loss_fits_the_critic_to_the_batchs_returns(actor_critic, small_tokenizer, prompts):  # noqa: F811
    """The critic's regression through the objective alone (advantages 0) makes the values the
    rollout batch reads (``scored_values``) explain the returns: the value head and its trunk
    are trained, at the positions they are read at."""
    batches = source(actor_critic, small_tokenizer, prompts, gamma=0.9, lam=0.8)
    micro = step_batches(batches)
    for mb in micro:
        mb["advantages"] = torch.zeros_like(mb["advantages"])
    b = whole(micro)
    mask = b["loss_mask"].bool()
    before = explained_variance(b["old_values"], b["returns"], mask)
    objective = PolicyObjective(batches.loss, vf_coef=1.0, value_clip=None)
    optimizer = torch.optim.Adam([p for p in actor_critic.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        optimizer.zero_grad()
        sum(objective(actor_critic, mb).loss_sum for mb in micro).backward()
        optimizer.step()
    with torch.no_grad():
        values = torch.cat([torch.zeros(len(mask), 1), scored_values(actor_critic, b["input_ids"], b["attention_mask"])], 1)
    after = explained_variance(values, b["returns"], mask)
    assert after > 0.9 and after > before + 0.5, (before, after)
