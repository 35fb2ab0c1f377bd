"""On-policy distillation (GKD, Agarwal et al. 2024): the student samples responses to prompts through
the inference engine, the teacher scores every token of them, and the loss is the per-token
generalised Jensen-Shannon divergence between the two next-token distributions on the student's own
tokens (β = 1, the default: the reverse KL KL(student ‖ teacher)), through the one training loop.

It is RL's batch source with a teacher in place of a reward: ``rl.trainer.RolloutBatches`` draws
`gkd.prompts_per_step` prompts x `rollout.n` samples of the current student per step (seeded, exactly
resumable), with no reward and no advantages; ``objectives.distill.OnPolicyDistillObjective`` runs the
student and the live, frozen teacher on the batch and logs `reverse_kl`, `forward_kl` (at τ = 1) and
`teacher_logprob` (the teacher's log-probability of the student's tokens), means per response token.
The rollout batch's own figures are logged as GRPO's are; its `reward_*` are 0 (there is no reward).
The teacher is any lmforge checkpoint with the student's tokenizer and vocabulary, of any size.

  lmforge distill recipes/distill/gkd.yaml
  lmforge distill recipes/distill/gkd.yaml objective.beta=0.5 rollout.temperature=1

Writes `final/` (and `adapter/` with LoRA) like sft and grpo; with `score.name: exact_match`, greedy
exact match on held-out tasks before and after. One process only so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.files import load_model_config
from lmforge.checkpoints.load import resolve_checkpoint
from lmforge.core.config import ConfigError, option, positive
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.distill import GKDConfig, OnPolicyDistillObjective, live_teacher
from lmforge.objectives.distill_teacher import check_teacher, load_teacher
from lmforge.peft.lora import LoraConfig
from lmforge.rl.correction import RLConfig
from lmforge.rl.losses import PolicyLossConfig
from lmforge.rl.objective import STAT_MAXIMA, STAT_PREFIX
from lmforge.rl.prompts import read_prompts
from lmforge.rl.rewards import Scores
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import RolloutBatchConfig, RolloutBatches
from lmforge.stages.finetune import FinetuneStage, adapter_line, run_finetune
from lmforge.stages.grpo import GRPODataConfig, exact_match_lines
from lmforge.stages.scoring import ScoreConfig, named_scorer
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines, read_metrics


@dataclass
class DistillRolloutConfig(RolloutConfig):
    n: int = positive(1, help="samples per prompt (each one's tokens are distilled; no group is needed)")
    max_new_tokens: int = positive(64, help="the longest response the student samples")


@dataclass
class DistillRecipe:
    run_dir: str = option(
        "runs/distill",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/pretrain", help="the student to start from")
    teacher: str = option("runs/sft", help="the teacher: an lmforge checkpoint or run directory with the student's "
                          "tokenizer and vocabulary (its size may differ)")
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    rollout: DistillRolloutConfig = field(default_factory=DistillRolloutConfig)
    gkd: RolloutBatchConfig = field(default_factory=RolloutBatchConfig)
    objective: GKDConfig = field(default_factory=GKDConfig)
    lora: LoraConfig | None = option(None, help="adapters only (the teacher is a checkpoint of its own either way)")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-5, warmup_steps=0, schedule="constant",
                                                                   grad_clip=1.0, eval_every=0, micro_batch_size=8,
                                                                   checkpoint_every=50, log_every=1))
    score: ScoreConfig = option(default_factory=ScoreConfig, help="scored before and after training (none by default)")
    parallel: ParallelConfig = option(default_factory=ParallelConfig, help="unused: one process only so far")


class NoReward:
    """The rollout batch's "reward": none (0 for every response); the teacher enters through the objective."""

    def __call__(self, rollouts) -> Scores:
        return Scores([0.0] * len(rollouts), {})


class NoEstimate:
    """No advantages: the objective reads the rollouts' tokens and masks only."""

    def __call__(self, batch: dict[str, torch.Tensor], all_sum=None) -> tuple[dict, dict]:
        return {}, {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def check_recipe(recipe: DistillRecipe, parallel: ParallelContext | None) -> Path:
    """What is refused before anything is written; the teacher's checkpoint directory."""
    if parallel is not None:
        raise ConfigError("distill runs in one process only so far; launch it without torchrun")
    if recipe.rollout.max_new_tokens >= recipe.data.max_length:
        raise ConfigError(f"rollout.max_new_tokens {recipe.rollout.max_new_tokens} leaves no room for a prompt in "
                          f"data.max_length {recipe.data.max_length}")
    if recipe.train.spikes.policy == "rollback":
        raise ConfigError("train.spikes.policy=rollback cannot replay rollouts; use skip or warn")
    recipe.gkd.check(recipe.rollout)
    base = resolve_checkpoint(recipe.checkpoint, verify=False)
    return check_teacher(recipe.teacher, base, load_model_config(base).vocab_size, recipe.data.max_length, key="teacher")


def distill_stage(recipe: DistillRecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Prompts as the examples, the student's rollouts as the batches, the divergence to the teacher as the loss."""
    teacher_dir = check_recipe(recipe, parallel)
    max_prompt = recipe.data.max_length - recipe.rollout.max_new_tokens

    def read_examples(paths, tok, max_length, *, on_bad, on_too_long, skipped):
        return read_prompts(paths, tok, required_fields=[], max_tokens=max_prompt, on_bad=on_bad, skipped=skipped)

    def objective(_reference):
        teacher = load_teacher(teacher_dir, resolve_device(recipe.train.device))
        return OnPolicyDistillObjective(recipe.objective, live_teacher(teacher), STAT_PREFIX, STAT_MAXIMA)

    def batches(run, model, cfg: TrainConfig):
        source = RolloutBatches(model, run.tok, run.train_examples, recipe.rollout, recipe.gkd,
                                PolicyLossConfig(kl_coef=0.0), NoReward(), cfg.micro_batch_size,
                                precision=cfg.precision, run_dir=run.run_dir, estimate=NoEstimate(),
                                correction=RLConfig(old_logprobs="engine"))  # no ratio: no old log-probs recomputed
        return source, source.grad_accum

    return FinetuneStage(
        "distill", read_examples, rows=lambda examples, tok: {}, objective=objective,
        scorer=lambda run, _rows: named_scorer(recipe.score, run.tok, recipe.data.val), batches=batches,
        summary={"teacher": str(teacher_dir), "beta": recipe.objective.beta,
                 "prompts_per_step": recipe.gkd.prompts_per_step, "samples_per_prompt": recipe.rollout.n})


def run_distill(recipe: DistillRecipe) -> dict:
    return run_finetune(recipe, "distill", distill_stage)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: the teacher, steps, the reverse KL's first and last step, exact match."""
    out = [f"- on-policy distillation from `{res.get('teacher')}` (β = {res.get('beta')}): {res.get('prompts_per_step')} "
           f"prompts x {res.get('samples_per_prompt')} samples per step, {res.get('step')} steps in "
           f"{res.get('wall_s', 0):.0f} s{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`",
           adapter_line(res, "distill", "recipes/distill/gkd.yaml")]
    rows = [r for r in read_metrics(stage_dir) if "reverse_kl" in r]
    if rows:
        out.append(f"- reverse KL to the teacher per response token: {rows[0]['reverse_kl']:.4f} at the first step, "
                   f"{rows[-1]['reverse_kl']:.4f} at the last")
    return (out + exact_match_lines(res) + precision_line(res)
            + loss_curve_lines(stage_dir, plot_path, ylabel="divergence to the teacher"))


RECIPE = DistillRecipe
run = run_distill
