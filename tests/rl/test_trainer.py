"""RL's batch source and objective: the first ratio is 1 on every token, the loop's summed
micro-batches equal ``rl.losses.policy_loss`` on the whole batch, the advantages are
``rl.advantages``'s, μ reuses one rollout batch, dynamic sampling drops and refills
zero-variance groups, and the state (a batch being reused included) round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.core.config import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.rl.advantages import grpo_advantages, per_token, reinforce_pp_advantages, rloo_advantages
from lmforge.rl.losses import PolicyLossConfig, entropy_from_logits, policy_loss
from lmforge.rl.objective import PolicyObjective, token_logprobs
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import Scores
from lmforge.rl.rollout import RolloutConfig, rollout_batch
from lmforge.rl.trainer import GRPOConfig, RolloutBatches, advantages_of, minibatch_order, reference_policy

STOPS = list(range(5, 45))  # a random model stops within a few tokens


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))


@pytest.fixture()
def prompts(small_tokenizer) -> list[Prompt]:
    texts = ["To be, or not", "Once upon a time there", "ROMEO.", "The quick brown fox", "Friends, Romans"]
    return [Prompt([small_tokenizer.bos_id, *small_tokenizer.encode(t)], f"p.jsonl:{i + 1}", t, {"i": i})
            for i, t in enumerate(texts)]


class LengthReward:
    """A verifier stand-in: the response's token count (spread within a group), and terms."""

    def __call__(self, rollouts):
        lengths = [float(len(r.response_ids)) for r in rollouts]
        return Scores([v / 10 for v in lengths], {"length": lengths})


class GroupReward:
    """Zero variance for every prompt whose field i is even (all G responses score i), else the length."""

    def __call__(self, rollouts):
        total = [float(r.prompt.fields["i"]) if r.prompt.fields["i"] % 2 == 0 else float(len(r.response_ids))
                 for r in rollouts]
        return Scores(total, {"g": total})


def source(model, tok, prompts, reward=None, *, loss=None, mbs=3, **grpo) -> RolloutBatches:
    rollout = RolloutConfig(n=4, max_new_tokens=10, stop_token_ids=STOPS, seed=1)
    loss = loss or PolicyLossConfig()
    cfg = GRPOConfig(prompts_per_step=2, **grpo)
    ref = reference_policy(model) if loss.kl_coef > 0 else None
    return RolloutBatches(model, tok, prompts, rollout, cfg, loss, reward or LengthReward(), mbs, reference=ref)


def step_batches(batches: RolloutBatches) -> list[dict]:
    return [next(batches) for _ in range(batches.grad_accum)]


def whole(micro: list[dict]) -> dict[str, torch.Tensor]:
    """The micro-batches as one batch, right-padded to the widest."""
    width = max(mb["input_ids"].shape[1] for mb in micro)

    def pad(x):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    return {k: torch.cat([pad(mb[k]) for mb in micro]) for k in micro[0] if micro[0][k].dim() == 2}


def test_a_group_size_of_one_is_refused(model, small_tokenizer, prompts):
    with pytest.raises(ConfigError, match="group size G.*at least 2"):
        RolloutBatches(model, small_tokenizer, prompts, RolloutConfig(n=1), GRPOConfig(), PolicyLossConfig(),
                       LengthReward(), 4)


def test_the_first_step_on_a_fresh_rollout_batch_has_ratio_one_on_every_token(model, small_tokenizer, prompts):
    batches = source(model, small_tokenizer, prompts, loss=PolicyLossConfig(kl_coef=0.1))
    objective = PolicyObjective(batches.loss)
    n_tokens = 0
    for mb in step_batches(batches):
        with torch.no_grad():
            logp, _ = token_logprobs(model, mb["input_ids"], mb["attention_mask"])
            out = objective(model, mb)
        mask = mb["loss_mask"][:, 1:]
        ratio = torch.exp(logp - mb["old_logprobs"][:, 1:])[mask]
        assert float((ratio - 1).abs().max()) < 1e-5
        assert abs(float(out.maxima["ratio_max"]) - 1) < 1e-5
        kl = mb["ref_logprobs"][:, 1:][mask] - logp[mask]  # the reference is the untrained policy
        assert float(kl.abs().max()) < 1e-5
        n_tokens += int(mask.sum())
    assert n_tokens > 8


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_loops_sum_over_micro_batches_is_policy_loss_on_the_whole_batch(model, small_tokenizer, prompts,
                                                                             aggregation):
    loss_cfg = PolicyLossConfig(clip_low=0.1, clip_high=0.3, kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01,
                                aggregation=aggregation, max_length=10)
    batches = source(model, small_tokenizer, prompts, loss=loss_cfg)
    micro = step_batches(batches)
    with torch.no_grad():  # move off-policy, so clipping and the ratio matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    objective = PolicyObjective(loss_cfg)
    n_targets = sum(objective.num_targets(mb) for mb in micro)
    ours = sum(objective(model, mb).loss_sum for mb in micro) / n_targets
    grad_ours = torch.autograd.grad(ours, model.embed.weight)[0]

    b = whole(micro)
    logp, logits = token_logprobs(model, b["input_ids"], b["attention_mask"])
    theirs, metrics = policy_loss(logp, b["old_logprobs"][:, 1:], b["advantages"][:, 1:], b["loss_mask"][:, 1:],
                                  loss_cfg, ref_logp=b["ref_logprobs"][:, 1:], entropy=entropy_from_logits(logits))
    grad_theirs = torch.autograd.grad(theirs, model.embed.weight)[0]
    ours, theirs = ours.detach(), theirs.detach()
    assert abs(float(ours) - float(theirs)) < 1e-5 * max(1.0, abs(float(theirs)))
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6, rtol=1e-4)
    outs = [objective(model, mb) for mb in micro]
    clip = sum(o.metrics["clip_frac"] for o in outs) / n_targets
    assert abs(float(clip) - float(metrics["clip_frac"])) < 1e-6  # a token mean over the step in every mode
    assert float(max(o.maxima["ratio_max"] for o in outs)) == pytest.approx(float(metrics["ratio_max"]))


def test_the_advantages_are_rl_advantages(model, small_tokenizer, prompts):
    batches = source(model, small_tokenizer, prompts)
    groups, _ = batches.draw_groups()
    b = rollout_batch([r for g in groups for r in g.rollouts], 2, [t for g in groups for t in g.totals])
    scores, ids, mask = b["rewards"], b["group_ids"], b["response_mask"]
    assert torch.equal(advantages_of("grpo", b), per_token(grpo_advantages(scores, ids), mask))
    assert torch.equal(advantages_of("dr_grpo", b), per_token(scores - scores.view(2, 4).mean(1).repeat_interleave(4),
                                                              mask))
    assert torch.equal(advantages_of("rloo", b), per_token(rloo_advantages(scores, ids), mask))
    last = torch.zeros(mask.shape)
    for i, n in enumerate(b["response_lengths"].tolist()):
        last[i, b["prompt_lengths"][i] + n - 1] = scores[i]
    assert torch.allclose(advantages_of("reinforce_pp", b), reinforce_pp_advantages(last, mask)[0])


def test_one_rollout_batch_serves_mu_steps_then_a_new_one_is_sampled(model, small_tokenizer, prompts):
    batches = source(model, small_tokenizer, prompts, updates_per_batch=3)
    first = step_batches(batches)
    assert batches.state.cursor == 2
    for _ in range(2):
        again = step_batches(batches)
        assert all(a is b for a, b in zip(first, again)) and batches.state.cursor == 2
    fresh = step_batches(batches)
    assert batches.state.cursor == 4 and fresh[0] is not first[0]


def test_dynamic_sampling_drops_zero_variance_groups_counts_them_and_refills(model, small_tokenizer, prompts):
    rollout = RolloutConfig(n=4, max_new_tokens=10, stop_token_ids=STOPS, seed=1, shuffle=False)
    drop = RolloutBatches(model, small_tokenizer, prompts, rollout, GRPOConfig(prompts_per_step=2, zero_variance="drop"),
                          PolicyLossConfig(), GroupReward(), 4)
    trained, sampled = drop.draw_groups()
    # file order: i = 0 (dropped), 1 (kept); refill 1: i = 2 (dropped); refill 2: i = 3 (kept)
    assert [g.rollouts[0].prompt.fields["i"] for g in sampled] == [0, 1, 2, 3]
    assert [g.rollouts[0].prompt.fields["i"] for g in trained] == [1, 3]
    stats = drop.statistics(sampled, trained)
    assert stats["zero_variance_share"] == 0.5 and stats["zero_variance_trained"] == 0 and stats["groups_sampled"] == 4
    short = RolloutBatches(model, small_tokenizer, prompts, rollout,
                           GRPOConfig(prompts_per_step=2, zero_variance="drop", max_refills=0), PolicyLossConfig(),
                           GroupReward(), 4)
    trained, sampled = short.draw_groups()  # no refill allowed: topped up with the zero-variance group
    assert [g.rollouts[0].prompt.fields["i"] for g in trained] == [1, 0] and len(sampled) == 2
    micro = step_batches(short)
    assert sum(int(mb["loss_mask"].sum()) > 0 for mb in micro) == 2
    zero = micro[1]  # the rows of the zero-variance group carry advantage 0
    assert float(zero["advantages"].abs().max()) == 0.0


def test_the_state_round_trips_inside_the_mu_steps_of_a_batch(model, small_tokenizer, prompts):
    batches = source(model, small_tokenizer, prompts, updates_per_batch=2)
    first = step_batches(batches)
    state = batches.state_dict()
    assert state["buffer"] is not None and state["uses_left"] == 1
    restored = source(model, small_tokenizer, prompts, updates_per_batch=2)
    restored.load_state_dict(json.loads(json.dumps(state)))  # the JSON of trainer_state.json
    again = step_batches(restored)
    for a, b in zip(first, again):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    step_batches(batches)  # the original's reuse of its batch
    assert batches.state_dict() == restored.state_dict() and batches.state_dict()["buffer"] is None
    fresh, fresh_restored = step_batches(batches), step_batches(restored)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(fresh, fresh_restored))


@pytest.mark.parametrize(("ranks", "m"), [(2, 2), (2, 4), (4, 2)])
def test_each_minibatch_holds_the_same_rows_whatever_the_ranks(ranks, m):
    rows = list(range(16))  # the global batch, rank r's share the r-th 16 / ranks rows
    share = 16 // ranks
    one = minibatch_order(rows, m)
    for i in range(m):
        per_rank = [minibatch_order(rows[r * share : (r + 1) * share], m)[i * share // m : (i + 1) * share // m]
                    for r in range(ranks)]
        assert sorted(x for part in per_rank for x in part) == sorted(one[i * 16 // m : (i + 1) * 16 // m])
    assert one[: 16 // m] == list(range(0, 16, m))
