"""PPO-RLHF (Ziegler et al. 2019; InstructGPT, Ouyang et al. 2022): the policy, a critic, a reward
(a reward model and/or verifiers) and a reference, through the one training loop and the
fine-tuning skeleton, built as `lmforge grpo` is.

Each rollout batch is `ppo.prompts_per_step` prompts x `rollout.n` responses of the current
policy, scored by `reward:` (`rl.rewards`: `reward_model` components read `lmforge reward`'s
model, whose tokenizer must be the policy's, refused before any rollout). The KL to the
reference goes in the reward (`ppo.kl_coef` β, `ppo.kl_estimator` k1, adaptive with
`ppo.kl_target`), the critic gives the values, GAE (`ppo.gamma`, `ppo.lam`) the advantages
(whitened) and returns (`rl.ppo`). Then `ppo.updates_per_batch` epochs of `ppo.minibatches`
optimizer steps each: the clipped policy loss (`objective:`, entropy bonus `entropy_coef`) +
`ppo.critic.vf_coef` x the value loss clipped at `ppo.critic.value_clip`. The critic
(`rl.critic`) is a value head on a transformer of its own (`ppo.critic.init`: policy |
reward_model | a checkpoint) or on the policy's trunk (`ppo.critic.kind: shared`). The reference is
the policy with its LoRA adapters disabled, or a frozen copy of the base.

Logged every step: reward mean/std, `score_<term>`, `kl` (per completion) and `kl_coef`,
entropy, clip fraction, approx KL, ratio mean/max, response length mean/max, value loss and
clip fraction, explained variance. Writes `final/` (the policy; `critic.safetensors` beside it)
and `adapter/` with LoRA, and resumes exactly (β and a batch being reused included).

  lmforge ppo recipes/demo/ppo.yaml
  lmforge ppo recipes/demo/ppo.yaml ppo.critic.kind=shared ppo.kl_target=6 lora.r=16 lora.alpha=32

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA), as grpo does: each
rank samples its share of every rollout batch (`ppo.prompts_per_step` a multiple of the ranks)
from a plain copy of the gathered policy; the advantages are whitened over every rank's tokens:

  torchrun --standalone --nproc_per_node=2 -m lmforge ppo recipes/demo/ppo.yaml train.device=cpu
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lmforge.core.config import ConfigError, option, positive
from lmforge.core.io import InputError
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.peft.lora import LoraConfig
from lmforge.rl.correction import RLConfig
from lmforge.rl.critic import ActorCritic, actor_critic
from lmforge.rl.losses import PolicyLossConfig
from lmforge.rl.objective import PolicyObjective
from lmforge.rl.ppo import PPOAdvantages, PPOConfig
from lmforge.rl.report import curve_lines, time_split_line
from lmforge.rl.rewards import Reward, RewardConfig
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import RolloutBatches, SamplingCopy
from lmforge.stages.finetune import FinetuneStage, adapter_line, run_finetune
from lmforge.stages.grpo import (
    GRPODataConfig,
    check_rollout_recipe,
    exact_match_lines,
    frozen_reference,
    prompt_reader,
)
from lmforge.stages.scoring import ScoreConfig, Scorer, named_scorer
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines


@dataclass
class PPORolloutConfig(RolloutConfig):
    n: int = positive(1, help="responses per prompt (the critic is the baseline: no group needed)")
    max_new_tokens: int = positive(64, help="the longest response; a response cut there counts as truncated")


@dataclass
class PPORecipe:
    run_dir: str = option(
        "runs/ppo",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/sft", help="the policy to start from (and the KL reference)")
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    rollout: PPORolloutConfig = field(default_factory=PPORolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    objective: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(kl_coef=0.0))
    rl: RLConfig = field(default_factory=RLConfig)
    lora: LoraConfig | None = option(None, help="adapters on the policy only; a separate critic trains whole")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-6, warmup_steps=0, schedule="constant",
                                                                   grad_clip=1.0, eval_every=0, micro_batch_size=8,
                                                                   checkpoint_every=50, log_every=1))
    score: ScoreConfig = field(default_factory=ScoreConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def check_recipe(recipe: PPORecipe) -> Path | None:
    """What can be refused before any model is loaded or any rollout sampled; returns the critic's
    init checkpoint (None: shared)."""
    if recipe.rl.rollout_workers:
        raise ConfigError("rl.rollout_workers: asynchronous rollouts are grpo's; ppo samples in-process "
                          "(rl.rollout_workers=0)")
    recipe.ppo.check(recipe.rollout)
    check_rollout_recipe(recipe)
    if recipe.objective.kl_coef > 0:
        raise ConfigError("objective.kl_coef: PPO puts the KL in the reward (ppo.kl_coef); set objective.kl_coef=0")
    return recipe.ppo.critic.init_path(recipe.checkpoint, recipe.reward)


def check_critic_tokenizer(init: Path | None, tok: Tokenizer) -> None:
    if init is not None and (theirs := Tokenizer.load(init)).sha256 != tok.sha256:
        raise InputError(f"ppo.critic.init: {init} has another tokenizer than the policy (tokenizer.json sha256 "
                         f"{theirs.sha256[:12]} vs {tok.sha256[:12]}): the critic would read other tokens")


def ppo_stage(recipe: PPORecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Prompts as the examples, rollouts as the batches, the actor-critic loss on an ``ActorCritic``."""
    init = check_recipe(recipe)
    critic = recipe.ppo.critic

    def batches(run, model, cfg: TrainConfig):
        reward = Reward(recipe.reward, run.tok, recipe.rollout.max_new_tokens, run.device)  # tokenizer checked
        check_critic_tokenizer(init, run.tok)
        sampler = (SamplingCopy(model, recipe.lora, run.device, prefix="backbone.") if parallel is not None
                   else lambda: model.backbone)
        source = RolloutBatches(model, run.tok, run.train_examples, recipe.rollout, recipe.ppo, recipe.objective,
                                reward, cfg.micro_batch_size, precision=cfg.precision,
                                reference=frozen_reference(recipe, run, model, cfg, parallel), mask_truncated=recipe.reward.mask_truncated,
                                run_dir=run.run_dir, parallel=parallel, sampler=sampler,
                                estimate=PPOAdvantages(recipe.ppo), critic=lambda ids, mask, at: scored_values(model, ids, mask),
                                correction=recipe.rl)
        return source, source.grad_accum

    return FinetuneStage(
        "ppo", prompt_reader(recipe), rows=lambda examples, tok: {},
        objective=lambda _reference: PolicyObjective(recipe.objective, critic.vf_coef, critic.value_clip,
                                                     correction=recipe.rl),
        scorer=lambda run, _rows: policy_scorer(named_scorer(recipe.score, run.tok, recipe.data.val)), batches=batches,
        head=actor_critic(init),
        summary={"critic": critic.kind, "prompts_per_step": recipe.ppo.prompts_per_step,
                 "responses_per_prompt": recipe.rollout.n})


def policy_scorer(scorer: Scorer | None) -> Scorer | None:
    """``scorer`` of the policy: before training the base itself, after it the ``ActorCritic``'s policy."""
    if scorer is None:
        return None
    return lambda model: scorer(model.backbone if isinstance(model, ActorCritic) else model)


def scored_values(model, ids, mask):
    """The critic's values of positions 0..T-2 (the state before each token 1..T-1), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return model.values(ids, mask)[:, :-1]
    finally:
        model.train(was_training)


def run_ppo(recipe: PPORecipe) -> dict:
    return run_finetune(recipe, "ppo", ppo_stage)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: steps, the critic, exact match before and after."""
    out = [f"- PPO with a {res.get('critic')} critic, {res.get('prompts_per_step')} prompts x "
           f"{res.get('responses_per_prompt')} responses per rollout batch, {res.get('step')} steps in "
           f"{res.get('wall_s', 0):.0f} s{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`",
           adapter_line(res, "ppo", "recipes/demo/ppo.yaml")]
    curves = curve_lines(stage_dir, plot_path.with_name(plot_path.stem.removesuffix("-loss") + "-rl.png"))
    return (out + exact_match_lines(res) + time_split_line(res) + precision_line(res) + curves
            + loss_curve_lines(stage_dir, plot_path, ylabel="PPO loss"))


RECIPE = PPORecipe
run = run_ppo
