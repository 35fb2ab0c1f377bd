"""Group-relative policy optimisation with verifiable rewards (GRPO, and Dr. GRPO, RLOO,
REINFORCE++ and DAPO's variants), through the one training loop and the fine-tuning skeleton.

Each optimizer step trains on a rollout batch: `grpo.prompts_per_step` prompts from
`data.train` (TRL's prompt JSONL/Parquet: `prompt` or `messages`, a final assistant turn being
the reference `answer`, plus the fields the reward reads), `rollout.n` (G >= 2) responses each
sampled from the current policy, scored by `reward:` (verifiers, a reward model, Python
callables, weighted, with length terms). The advantages (`grpo.advantage`: grpo | dr_grpo | rloo
| reinforce_pp) feed PPO's clipped surrogate (`objective:`: clip_low/clip_high, kl_coef and
kl_estimator k1/k2/k3 against the reference, entropy_coef, aggregation, token-mean over the
global batch by default) for `grpo.updates_per_batch` (μ) steps. `grpo.zero_variance: drop` is
DAPO's dynamic sampling (groups whose rewards are all equal are dropped, counted and refilled);
`reward.mask_truncated` its overlong filtering. The reference is the policy with its LoRA
adapters disabled, or a frozen copy under full fine-tuning (none at all with kl_coef 0).

Logged every step (metrics.jsonl): reward mean/std, `score_<term>` per reward term, KL to the
reference, entropy, clip fractions, approx KL, ratio mean/max, response length mean/max, the
share of zero-variance groups; every `grpo.samples_every` steps the sampled prompts,
responses and rewards in `run_dir/samples/`. Writes `final/` (and `adapter/` with LoRA) like
sft and dpo, and resumes exactly (the rollout state and a batch being reused included).
With `score.name: exact_match`, greedy exact match on held-out tasks before and after.

  lmforge grpo recipes/demo/grpo.yaml
  lmforge grpo recipes/demo/grpo.yaml grpo.advantage=dr_grpo grpo.zero_variance=drop objective.clip_high=0.28

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA), laid out by its
`parallel:` section: each rank samples its share of every rollout batch, whole groups
(`grpo.prompts_per_step` a multiple of the ranks), from a plain copy of the gathered policy
(the engine's forwards differ in number between ranks, which a sharded model cannot run);
the loss is the token mean over every rank's tokens, REINFORCE++ whitens over them too:

  torchrun --standalone --nproc_per_node=2 -m lmforge grpo recipes/demo/grpo.yaml train.device=cpu
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lmforge.checkpoints.load import load_model
from lmforge.core.config import ConfigError, option, positive, seed_field
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.peft.lora import LoraConfig
from lmforge.rl.correction import RLConfig
from lmforge.rl.losses import PolicyLossConfig
from lmforge.rl.objective import PolicyObjective
from lmforge.rl.prompts import read_prompts
from lmforge.rl.report import curve_lines, time_split_line
from lmforge.rl.rewards import Reward, RewardConfig
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import GRPOConfig, RolloutBatches, SamplingCopy, reference_policy
from lmforge.rl.workers import async_batches
from lmforge.stages.finetune import FinetuneStage, adapter_line, run_finetune
from lmforge.stages.scoring import ScoreConfig, named_scorer, task_changes
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines
from lmforge.train.prepare import prepare_model


@dataclass
class GRPODataConfig:
    train: list[str] = option(default_factory=list, help="prompt files (JSONL/Parquet) or globs")
    val: list[str] = option(
        default_factory=list, help="held-out tasks (conversations ending with the answer) for score:"
    )
    max_length: int = positive(256, help="prompt + response tokens; a prompt must leave rollout.max_new_tokens")
    on_bad: Literal["error", "skip"] = option(
        "error", help="a bad prompt record (none, empty, a reward field missing, too long)"
    )
    on_too_long: Literal["error", "skip"] = option("error", help="unused: a too-long prompt is a bad record (on_bad)")
    seed: int = seed_field(0, help="unused: rollout.seed orders the prompts")


@dataclass
class GRPORolloutConfig(RolloutConfig):
    n: int = positive(8, help="G: responses per prompt (at least 2)")
    max_new_tokens: int = positive(64, help="the longest response; a response cut there counts as truncated")


@dataclass
class GRPORecipe:
    run_dir: str = option(
        "runs/grpo",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/sft", help="the policy to start from (and the KL reference)")
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    rollout: GRPORolloutConfig = field(default_factory=GRPORolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    objective: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(kl_coef=0.0))
    rl: RLConfig = field(default_factory=RLConfig)
    lora: LoraConfig | None = option(None, help="adapters only; the reference is then the model with adapters disabled")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-6, warmup_steps=0, schedule="constant",
                                                                   grad_clip=1.0, eval_every=0, micro_batch_size=8,
                                                                   checkpoint_every=50, log_every=1))
    score: ScoreConfig = option(default_factory=ScoreConfig, help="scored before and after training (none by default)")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def check_recipe(recipe: GRPORecipe) -> None:
    """What can be refused before any model is loaded or any rollout sampled."""
    recipe.grpo.check(recipe.rollout)  # a group size of 1 first
    check_rollout_recipe(recipe)


def check_rollout_recipe(recipe) -> None:
    """The checks every RL recipe (grpo, ppo) shares: its reward, room for a prompt, no rollback."""
    recipe.reward.check()
    if recipe.rollout.max_new_tokens >= recipe.data.max_length:
        raise ConfigError(f"rollout.max_new_tokens {recipe.rollout.max_new_tokens} leaves no room for a prompt in "
                          f"data.max_length {recipe.data.max_length}")
    if recipe.train.spikes.policy == "rollback":
        raise ConfigError("train.spikes.policy=rollback cannot replay rollouts; use skip or warn")


def prompt_reader(recipe):
    """The skeleton's ``read_examples`` for an RL recipe: its prompt files, with the fields its
    reward needs and room for ``rollout.max_new_tokens`` after each prompt."""
    max_prompt = recipe.data.max_length - recipe.rollout.max_new_tokens

    def read_examples(paths, tok, max_length, *, on_bad, on_too_long, skipped):
        return read_prompts(paths, tok, required_fields=recipe.reward.required_fields(), max_tokens=max_prompt,
                            on_bad=on_bad, skipped=skipped)

    return read_examples


def frozen_reference(recipe, run, model, cfg: TrainConfig, parallel: ParallelContext | None):
    """The KL reference: the policy with its adapters disabled (LoRA), or for full fine-tuning the
    base again, prepared (sharded) as the policy and never trained."""
    frozen = None if recipe.lora is not None else prepare_model(load_model(run.base_dir, device=run.device)[0],
                                                                cfg, parallel, frozen=True)
    return reference_policy(model, frozen)


def exact_match_lines(res: dict) -> list[str]:
    """The report's line of held-out exact match before and after, when it was scored."""
    before, after = (res.get("before") or {}).get("exact_match"), (res.get("after") or {}).get("exact_match")
    if not (before and after):
        return []
    by_task = task_changes(before, after)
    return [f"- exact match on {after['examples']} held-out tasks: **{100 * before['exact_match']:.1f}% before, "
            f"{100 * after['exact_match']:.1f}% after**" + (f" (right answers by task: {by_task})" if by_task else "")]


def grpo_stage(recipe: GRPORecipe, parallel: ParallelContext | None = None, opened: list | None = None) -> FinetuneStage:
    """Prompts as the examples, rollouts of the policy as the batches, the clipped policy loss;
    with ``rl.rollout_workers``, from worker processes (``rl.workers``), which ``opened`` collects to close."""
    check_recipe(recipe)
    if parallel is not None and recipe.rl.rollout_workers:
        raise ConfigError("rl.rollout_workers: asynchronous rollouts run in one process; under torchrun each rank "
                          "samples in-process (rl.rollout_workers=0)")

    def batches(run, model, cfg: TrainConfig):
        loss = recipe.objective
        reward = Reward(recipe.reward, run.tok, recipe.rollout.max_new_tokens, run.device)
        reference = frozen_reference(recipe, run, model, cfg, parallel) if loss.kl_coef > 0 else None
        sampler = SamplingCopy(model, recipe.lora, run.device) if parallel is not None else None
        kwargs = dict(precision=cfg.precision, reference=reference, mask_truncated=recipe.reward.mask_truncated,
                      run_dir=run.run_dir, parallel=parallel, sampler=sampler, correction=recipe.rl)
        if recipe.rl.rollout_workers:
            source = async_batches(recipe, model, run.tok, run.train_examples, run.device, reward,
                                   cfg.micro_batch_size, **kwargs)
            if opened is not None:
                opened.append(source)
        else:
            source = RolloutBatches(model, run.tok, run.train_examples, recipe.rollout, recipe.grpo, loss, reward,
                                    cfg.micro_batch_size, **kwargs)
        return source, source.grad_accum

    return FinetuneStage(
        "grpo", prompt_reader(recipe), rows=lambda examples, tok: {}, objective=lambda _reference: PolicyObjective(recipe.objective, correction=recipe.rl),
        scorer=lambda run, _rows: named_scorer(recipe.score, run.tok, recipe.data.val), batches=batches,
        summary={"advantage": recipe.grpo.advantage, "group_size": recipe.rollout.n,
                 "prompts_per_step": recipe.grpo.prompts_per_step})


def run_grpo(recipe: GRPORecipe) -> dict:
    opened: list = []  # asynchronous rollouts' worker pools, stopped however the run ends
    try:
        return run_finetune(recipe, "grpo", lambda r, ctx: grpo_stage(r, ctx, opened))
    finally:
        for source in opened:
            source.close()


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: steps, the reward/KL/length curves (``rl.report``), where a
    step's time went, exact match before and after, and the policy loss."""
    out = [f"- `{res.get('advantage')}` advantages, {res.get('prompts_per_step')} prompts x {res.get('group_size')} "
           f"responses per step, {res.get('step')} steps in {res.get('wall_s', 0):.0f} s"
           f"{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`",
           adapter_line(res, "grpo", "recipes/demo/grpo.yaml")]
    curves = curve_lines(stage_dir, plot_path.with_name(plot_path.stem.removesuffix("-loss") + "-rl.png"))
    return (out + exact_match_lines(res) + time_split_line(res) + precision_line(res) + curves
            + loss_curve_lines(stage_dir, plot_path, ylabel="policy loss"))


RECIPE = GRPORecipe
run = run_grpo
