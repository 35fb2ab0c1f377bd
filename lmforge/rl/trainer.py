"""RL's batch source: rollouts of the policy being trained, scored and turned into the
micro-batches ``rl.objective.PolicyObjective`` trains on, served to the one training loop.

There is no second training loop. The loop asks its ``train_batches`` for ``grad_accum``
micro-batches per optimizer step; ``RolloutBatches`` answers with a *rollout batch*:

1. sample ``prompts_per_step`` prompts x G (``rollout.n``) responses from the current policy
   through the inference engine (``rl.rollout.sample_rollouts``: its state, ``RolloutState``,
   says which prompts come next and seeds every request);
2. score them (``rl.rewards.Reward``); with ``zero_variance: drop`` (DAPO's dynamic sampling),
   leave out the groups whose G rewards are all equal (their group-relative advantage is 0),
   count them and sample more prompts for the shortfall, up to ``max_refills`` more rounds;
   a batch still short after that is topped up with zero-variance groups (advantage 0), so
   every optimizer step has the same number of rows (the loop's ``grad_accum`` is fixed);
3. score the batch's forwards: the reference's log-probs when there is a reference (GRPO: a KL
   term in the loss; ``kl_coef`` 0: no reference forward at all; PPO: the KL in the reward),
   the critic's values when there is a critic (PPO), and, when ``rl.old_logprobs`` asks for it
   (by default in a precision other than fp32, or with a rollout correction), the old log-probs
   recomputed by the trainer's own forward (so the first ratio is exactly 1 there too; in fp32
   the engine's log-probs already are the trainer's to 1e-5, ``tests/rl/test_trainer.py``); with
   a rollout correction (``rl.correction``) the engine's log-probs stay beside them as
   ``rollout_logprobs``, which the objective's importance weight compares them with;
   then its ``estimate``: GRPO's advantages over the batch (``advantage``: ``grpo``,
   ``dr_grpo``, ``rloo``, ``reinforce_pp``; ``rl.advantages``) or PPO's (``rl.ppo``);
4. serve its micro-batches to ``updates_per_batch`` (μ) passes over the batch, each pass
   ``minibatches`` optimizer steps (1 by default: a step is a full pass): the first pass
   on-policy (ratio 1), the next ones off-policy and clipped.

Its ``state_dict`` is the rollout state, the micro-batches drawn, the estimate's state (PPO's
adaptive KL coefficient), and the rollout batch being reused when a checkpoint falls inside its
μ steps (so a resumed run trains on the very same rows): an interrupted and resumed run equals
the uninterrupted one.

Every ``samples_every`` steps the batch's prompts, responses, rewards and reward terms go to
``run_dir/samples/step-NNNNNN.jsonl`` (rewritten whole by a resumed run, so never duplicated).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.checkpoints.files import load_weights
from lmforge.core.config import ConfigError, at_least, option, positive
from lmforge.core.io import InputError, atomic_write_text
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.mesh import ParallelContext, data_parallel_rank
from lmforge.inference.engine import release_decoding_view
from lmforge.model.families import build as build_model
from lmforge.model.transformer import Transformer
from lmforge.peft.lora import LoraConfig, apply_lora, disable_adapters, lora_modules
from lmforge.rl.advantages import (
    AllSum,
    grpo_advantages,
    local_sum,
    per_token,
    reinforce_pp_advantages,
    rloo_advantages,
)
from lmforge.rl.correction import RLConfig
from lmforge.rl.losses import PolicyLossConfig
from lmforge.rl.objective import STAT_PREFIX, token_logprobs
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import Reward
from lmforge.rl.rollout import Rollout, RolloutConfig, RolloutState, rollout_batch, sample_rollouts
from lmforge.train.forward import autocast_context

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
SAMPLES = "samples"
PHASES = {"ref_logprobs": "reference", "values": "critic", "old_logprobs": "old_logprobs"}  # scoring forwards' time/<phase>_s


@dataclass
class RolloutBatchConfig:
    """How rollout batches are drawn and served, GRPO's and PPO's alike."""

    prompts_per_step: int = positive(8, help="prompts (groups of rollout.n responses) per rollout batch")
    updates_per_batch: int = positive(1, help="μ: passes over each rollout batch (TRL's num_iterations, PPO's epochs)")
    minibatches: int = positive(1, help="optimizer steps per pass, minibatch i on the batch's rows i mod m")
    zero_variance: Literal["keep", "drop"] = option(
        "keep", help="drop: DAPO's dynamic sampling (refilled, see max_refills)"
    )
    max_refills: int = at_least(0, 3, help="drop: extra rounds of sampling that replace the dropped groups")
    samples_every: int = at_least(0, 10, help="steps between samples/step-N.jsonl dumps (0: none)")

    def check(self, rollout: RolloutConfig) -> None:
        rows = self.prompts_per_step * rollout.n
        if rows % self.minibatches:
            raise ConfigError(f"minibatches {self.minibatches} must divide the rollout batch's {rows} rows "
                              f"(prompts_per_step {self.prompts_per_step} x rollout.n {rollout.n})")


@dataclass
class GRPOConfig(RolloutBatchConfig):
    """The ``grpo:`` section: how rollout batches are drawn and turned into advantages."""

    advantage: Estimator = option(
        "grpo",
        help="grpo: (r - mean) / std of the group; dr_grpo: r - mean (no std); rloo: leave-one-out mean; "
        "reinforce_pp: the score at the last token, whitened over every response token of the batch",
    )

    def check(self, rollout: RolloutConfig) -> None:
        if rollout.n < 2:
            raise ConfigError(f"rollout.n (the group size G) is {rollout.n}: group-relative advantages compare the "
                              f"responses to one prompt, so GRPO needs at least 2 per prompt (e.g. rollout.n=8)")
        if self.advantage not in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            raise ConfigError(f"grpo.advantage must be grpo, dr_grpo, rloo or reinforce_pp, got {self.advantage!r}")
        super().check(rollout)


@dataclass
class ScoredGroup:
    """The G rollouts of one prompt with their rewards."""

    rollouts: list[Rollout]
    totals: list[float]
    terms: dict[str, list[float]]

    @property
    def zero_variance(self) -> bool:
        return max(self.totals) - min(self.totals) <= 1e-6 * max(1.0, max(abs(t) for t in self.totals))


# (input_ids, attention_mask, at) -> (B, T-1): the log-probs of the tokens ``at`` marks (the loss mask),
# 0 elsewhere (``rl.objective.token_logprobs``), or a critic's values (which reads no ``at``)
TokenLogprobs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_policy(model: nn.Module, frozen: nn.Module | None = None) -> TokenLogprobs:
    """The KL reference as a function of (input_ids, attention_mask, at) -> token log-probs (B, T-1):
    the policy with its LoRA adapters disabled (no second copy), else ``frozen``, the base
    prepared as the policy but never trained (sharded like it under torchrun), or, without one,
    a frozen copy of the policy taken now, before any update (DPO's references, ``objectives.reference``)."""
    if lora_modules(model):
        def adapters_off(ids, mask, at):
            with disable_adapters(model):
                return _scored(model, ids, mask, at)
        return adapters_off
    frozen = frozen if frozen is not None else copy.deepcopy(model)
    frozen.eval().requires_grad_(False)
    return lambda ids, mask, at: _scored(frozen, ids, mask, at)


class SamplingCopy:
    """What a data-parallel rank samples with: a plain copy of the whole sharded policy (LoRA
    layers included), its weights gathered from the shards before each rollout batch. The
    engine's continuous batching runs a different number of forwards on each rank, which a
    sharded model (every forward a collective) cannot; the copy costs one model per rank."""

    def __init__(self, model: nn.Module, lora: LoraConfig | None, device: torch.device, prefix: str = ""):
        self.model, self.lora, self.device, self.prefix = model, lora, device, prefix
        self.copy: Transformer | None = None

    def __call__(self) -> Transformer:
        """``prefix``: the policy's names inside ``model`` (PPO's ``ActorCritic``: ``backbone.``)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        if self.prefix:
            state = {k[len(self.prefix):]: v for k, v in state.items() if k.startswith(self.prefix)}
        if self.copy is None:
            with torch.device("meta"):
                plain = build_model(self.model.cfg)
                if self.lora is not None:
                    apply_lora(plain, self.lora)
            self.copy = plain.to_empty(device=self.device).requires_grad_(False)
        load_weights(self.copy, state, where="the gathered shards of the policy")
        return self.copy.eval()


def _scored(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return token_logprobs(model, ids, mask, at)[0]
    finally:
        model.train(was_training)


def aligned(logp: torch.Tensor) -> torch.Tensor:
    """Token log-probs of positions 1..T-1 laid out like ``input_ids`` (position 0: 0)."""
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp.float()], 1)


def advantages_of(estimator: Estimator, batch: dict[str, torch.Tensor], all_sum: AllSum = local_sum) -> torch.Tensor:
    """Per-token advantages (B, T) aligned with ``input_ids``, 0 off the response; REINFORCE++'s
    whitened over every rank's loss tokens (``all_sum``: the sum over the data-parallel ranks)."""
    scores, groups, mask = batch["rewards"], batch["group_ids"], batch["response_mask"]
    if estimator == "reinforce_pp":
        loss_mask = batch["loss_mask"]
        token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
        positions = torch.arange(mask.shape[1]).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(-1)
        token_rewards[torch.arange(len(scores)), last] = scores
        if not int(all_sum(loss_mask.sum())):  # no rank has a loss token
            return torch.zeros_like(token_rewards)
        return reinforce_pp_advantages(token_rewards, loss_mask, all_sum=all_sum)[0]
    if estimator == "rloo":
        adv = rloo_advantages(scores, groups)
    else:
        adv = grpo_advantages(scores, groups, scale="group" if estimator == "grpo" else "none")
    return per_token(adv, mask)


class GroupAdvantages:
    """GRPO's estimators as the rollout batch's ``estimate(batch, all_sum)``: (columns to add,
    figures to log) of this rank's share of a batch; ``all_sum`` sums a tensor over the
    data-parallel ranks (REINFORCE++'s global statistics).
    PPO's (``rl.ppo.PPOAdvantages``) reads the critic's values and the reference's log-probs too."""

    def __init__(self, estimator: Estimator):
        self.estimator = estimator

    def __call__(self, batch: dict[str, torch.Tensor],
                 all_sum: AllSum = local_sum) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return {"advantages": advantages_of(self.estimator, batch, all_sum)}, {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class RolloutBatches:
    """The loop's ``train_batches`` for RL (module docstring). ``reference`` is None without a KL
    term; ``precision`` the loop's and ``correction`` the recipe's ``rl:`` (``RLConfig.recomputes``:
    whether the trainer recomputes the old log-probs; with a rollout correction the batch keeps
    the engine's as ``rollout_logprobs``).

    Under ``parallel`` (a data-parallel torchrun rank) each rank samples, scores and trains its
    share of every rollout batch, whole groups (``prompts_per_step / dp`` prompts), from the one
    global prompt order: the ranks agree on each round's counts, and each takes its slice of
    the prompts every rank's ``RolloutState`` steps over, so the state is the same on all. It
    samples with ``sampler()`` (``SamplingCopy``); the logged figures and the token counts are
    over every rank's rollouts.

    ``estimate`` turns the scored batch into the columns the objective reads (default: GRPO's
    ``cfg.advantage``); ``critic`` (ids, mask) -> values (B, T-1), like the log-probs, adds the
    batch's ``values`` column for it (PPO). With ``cfg.minibatches`` m each pass over the batch is
    m optimizer steps, each on 1/m of its rows (rows i mod m, ``minibatch_order``: the same rows
    under torchrun as in one process)."""

    def __init__(self, model: nn.Module, tok: Tokenizer, prompts: Sequence[Prompt], rollout: RolloutConfig,
                 cfg: RolloutBatchConfig, loss: PolicyLossConfig, reward: Reward, micro_batch_size: int, *,
                 precision: str = "fp32", reference: TokenLogprobs | None = None, mask_truncated: bool = False,
                 run_dir: Path | None = None, parallel: ParallelContext | None = None,
                 sampler: Callable[[], nn.Module] | None = None, estimate=None,
                 critic: TokenLogprobs | None = None, correction: RLConfig | None = None):
        cfg.check(rollout)
        self.correction = correction if correction is not None else RLConfig()
        self.recompute = self.correction.recomputes(precision)
        self.estimate = estimate if estimate is not None else GroupAdvantages(cfg.advantage)
        if loss.kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef {loss.kl_coef} needs a reference policy")
        self.rank, self.dp = data_parallel_rank(parallel)
        if cfg.prompts_per_step % self.dp:
            raise ConfigError(f"grpo.prompts_per_step {cfg.prompts_per_step} must be a multiple of the {self.dp} "
                              f"data-parallel ranks: each samples whole groups")
        self.model, self.tok, self.prompts, self.rollout, self.cfg = model, tok, list(prompts), rollout, cfg
        self.loss, self.reward, self.micro_batch_size = loss, reward, micro_batch_size
        self.precision, self.reference, self.mask_truncated, self.run_dir = precision, reference, mask_truncated, run_dir
        self.parallel, self.sampler, self.critic = parallel, sampler or (lambda: model), critic
        self.per_rank = cfg.prompts_per_step // self.dp
        self.rows = self.per_rank * rollout.n
        if self.rows % cfg.minibatches:
            raise ConfigError(f"minibatches {cfg.minibatches} must divide each rank's {self.rows} rows")
        self.minibatch_rows = self.rows // cfg.minibatches
        self.grad_accum = math.ceil(self.minibatch_rows / micro_batch_size)  # micro-batches per optimizer step
        self.state = RolloutState(rollout.seed, len(self.prompts), rollout.shuffle)
        self.buffer: list[dict[str, torch.Tensor]] = []
        self.position = 0  # next micro-batch of the buffer
        self.uses_left = 0  # optimizer steps the buffer still serves
        self.drawn = 0  # micro-batches served so far: drawn // grad_accum is the step
        self.timings: dict[str, float] = {}  # seconds per phase since the loop last asked (pop_timings)

    def __iter__(self) -> RolloutBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position == 0 and self.uses_left == 0:
            self.buffer = self.next_rollout_batch(step=self.drawn // self.grad_accum)
            self.uses_left = self.cfg.updates_per_batch
        batch = self.buffer[self.position]
        self.position, self.drawn = self.position + 1, self.drawn + 1
        if self.position == len(self.buffer):
            self.position, self.uses_left = 0, self.uses_left - 1
        return batch

    def pop_timings(self) -> dict[str, float]:
        """Seconds spent since the last call in ``rollout`` (sampling, with the gathering of the
        sampling copy's weights), ``reward`` and the batch's scoring forwards (``reference``,
        ``critic``, ``old_logprobs``): the loop logs them as ``time/<phase>_s``. A step that reuses
        the batch (μ > 1) spends none."""
        timings, self.timings = self.timings, {}
        return timings

    def timed(self, phase: str, began: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - began

    # ------------------------------------------------------------------ sampling and scoring

    def gather(self, value):
        """``value`` of every data-parallel rank, in rank order (``[value]`` in one process)."""
        if self.dp == 1:
            return [value]
        out = [None] * self.dp
        dist.all_gather_object(out, value, group=self.parallel.dp_flat.get_group())
        return out

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the data-parallel ranks (an all_reduce; ``x`` itself in one process)."""
        if self.dp == 1:
            return x
        total = x.to(self.parallel.device, copy=True)
        dist.all_reduce(total, group=self.parallel.dp_flat.get_group())
        return total.to(x.device)

    def sample_share(self, model: nn.Module, needs: list[int]) -> list[list[Rollout]]:
        """This rank's ``needs[rank]`` next prompts of the global order, which the ranks before it
        take first; the state moves past every rank's."""
        before, mine = sum(needs[: self.rank]), needs[self.rank]
        self.state.take(before)
        groups = sample_rollouts(model, self.tok, self.prompts, self.rollout, self.state, mine) if mine else []
        self.state.take(sum(needs) - before - mine)
        return groups

    def draw_groups(self) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
        """(this rank's groups to train on, every group it sampled), per ``zero_variance`` (module docstring)."""
        target, kept, dropped, sampled = self.per_rank, [], [], []
        began = time.perf_counter()
        model = self.sampler()
        self.timed("rollout", began)
        for _ in range(1 + (self.cfg.max_refills if self.cfg.zero_variance == "drop" else 0)):
            needs = self.gather(target - len(kept))
            if not sum(needs):
                break
            began = time.perf_counter()
            groups = self.sample_share(model, needs)
            self.timed("rollout", began)
            began = time.perf_counter()
            scores = self.reward([r for g in groups for r in g]) if groups else None
            self.timed("reward", began)
            start = 0
            for g in groups:
                cut = slice(start, start + len(g))
                scored = ScoredGroup(g, scores.total[cut], {k: v[cut] for k, v in scores.terms.items()})
                start += len(g)
                sampled.append(scored)
                (dropped if self.cfg.zero_variance == "drop" and scored.zero_variance else kept).append(scored)
        release_decoding_view(model)  # the engine's fused copy of the weights: not needed while training
        return kept + dropped[: target - len(kept)], sampled

    def micro_batch_rows(self) -> list[slice]:
        """The rows of each micro-batch, ``grad_accum`` per minibatch (optimizer step)."""
        return [slice(start, min(start + self.micro_batch_size, first + self.minibatch_rows))
                for first in range(0, self.rows, self.minibatch_rows)
                for start in range(first, first + self.minibatch_rows, self.micro_batch_size)]

    def next_rollout_batch(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Sample, score and lay out the next rollout batch as ``minibatches x grad_accum`` micro-batches."""
        groups, sampled = self.draw_groups()
        rows = minibatch_order([(r, t) for g in groups for r, t in zip(g.rollouts, g.totals)], self.cfg.minibatches)
        batch = rollout_batch([r for r, _ in rows], self.tok.pad_id, [t for _, t in rows], self.mask_truncated)
        if self.correction.corrects:
            batch["rollout_logprobs"] = batch["old_logprobs"].clone()  # the engine's: old_logprobs may be recomputed
        slices = self.micro_batch_rows()
        self.add_logprobs(batch, slices)
        columns, figures = self.estimate(batch, self.all_sum)
        batch |= columns
        stats = self.statistics(sampled, groups) | figures
        if self.run_dir is not None and self.cfg.samples_every and step % self.cfg.samples_every == 0:
            self.write_samples(step + 1, sampled, groups)
        keys = ["input_ids", "attention_mask", "loss_mask", "old_logprobs", *columns]
        if self.correction.corrects:
            keys.append("rollout_logprobs")
        if self.reference is not None and self.loss.kl_coef > 0:
            keys.append("ref_logprobs")
        per_token_mode = self.loss.aggregation == "token-mean"
        micro = []
        for first in range(0, self.rows, self.minibatch_rows):
            mine = batch["loss_mask"][first : first + self.minibatch_rows]
            counts = self.gather((int(mine.sum()), int(mine.any(-1).sum())))
            n_tokens = sum(c[0] for c in counts)
            n_targets = n_tokens if per_token_mode else sum(c[1] for c in counts)
            for rows in slices[len(micro) : len(micro) + self.grad_accum]:
                width = int(batch["attention_mask"][rows].sum(-1).max())
                mb = {key: batch[key][rows, :width] for key in keys}
                n = len(mb["input_ids"])
                mb["targets_per_token"] = torch.full((n,), n_targets / max(n_tokens, 1), dtype=torch.float32)
                mb |= {STAT_PREFIX + k: torch.full((n,), v, dtype=torch.float32) for k, v in stats.items()}
                micro.append(mb)
        return micro

    @torch.no_grad()
    def add_logprobs(self, batch: dict[str, torch.Tensor], slices: list[slice]) -> None:
        """The reference's log-probs (with a reference), the critic's values (with a critic) and, when
        ``self.recompute``, the old log-probs by the trainer's forward: full (B, T) columns, each
        micro-batch's rows scored at its own width (the width it trains at), 0 off the loss mask."""
        device = self.parallel.device if self.parallel is not None else self.model.embed.weight.device
        scorers = {}
        if self.reference is not None:
            scorers["ref_logprobs"] = self.reference
        if self.recompute:
            scorers["old_logprobs"] = lambda ids, mask, at: _scored(self.model, ids, mask, at)
        if self.critic is not None:
            scorers["values"] = self.critic
        for key in scorers:
            batch[key] = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for rows in slices:
            width = int(batch["attention_mask"][rows].sum(-1).max())
            ids, mask = batch["input_ids"][rows, :width].to(device), batch["attention_mask"][rows, :width].to(device)
            at = batch["loss_mask"][rows, :width].bool().to(device)
            with autocast_context(device, self.precision):
                for key, scorer in scorers.items():
                    began = time.perf_counter()
                    batch[key][rows, :width] = aligned(scorer(ids, mask, at)).cpu() * batch["loss_mask"][rows, :width]
                    self.timed(PHASES[key], began)

    def statistics(self, sampled: list[ScoredGroup], trained: list[ScoredGroup]) -> dict[str, float]:
        """The figures logged with every step this batch serves, over every response sampled for it (on every rank)."""
        mine = {"totals": [t for g in sampled for t in g.totals],
                "lengths": [len(r.response_ids) for g in sampled for r in g.rollouts],
                "truncated": sum(r.truncated for g in sampled for r in g.rollouts),
                "zero": sum(g.zero_variance for g in sampled), "groups": len(sampled),
                "zero_trained": sum(g.zero_variance for g in trained),
                "terms": {k: [v for g in sampled for v in g.terms[k]] for k in (sampled[0].terms if sampled else {})}}
        ranks = self.gather(mine)
        totals = torch.tensor([t for r in ranks for t in r["totals"]])
        lengths = torch.tensor([n for r in ranks for n in r["lengths"]], dtype=torch.float32)
        stats = {"reward_mean": float(totals.mean()), "reward_std": float(totals.std()) if len(totals) > 1 else 0.0,
                 "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
                 "truncated_share": sum(r["truncated"] for r in ranks) / len(lengths),
                 "zero_variance_share": sum(r["zero"] for r in ranks) / sum(r["groups"] for r in ranks),
                 "zero_variance_trained": float(sum(r["zero_trained"] for r in ranks)),
                 "groups_sampled": float(sum(r["groups"] for r in ranks))}
        if self.rollout.n == 1:  # a group of one always has zero variance: the figures say nothing
            for key in ("zero_variance_share", "zero_variance_trained"):
                del stats[key]
        for name in ranks[0]["terms"]:
            stats[f"score_{name}"] = float(torch.tensor([v for r in ranks for v in r["terms"][name]]).mean())
        return stats

    def write_samples(self, step: int, sampled: list[ScoredGroup], trained: list[ScoredGroup]) -> None:
        keep = {id(g) for g in trained}
        lines = []
        for g in sampled:
            for i, r in enumerate(g.rollouts):
                lines.append(json.dumps({"step": step, "group": r.group, "sample": r.sample, "source": r.prompt.source,
                                         "prompt": r.prompt.prompt, "response": r.text, "reward": g.totals[i],
                                         "terms": {k: v[i] for k, v in g.terms.items()},
                                         "tokens": len(r.response_ids), "finish_reason": r.finish_reason,
                                         "trained": id(g) in keep,
                                         **({"versions": r.versions} if r.versions is not None else {})},
                                        ensure_ascii=False) + "\n")
        every = self.gather(lines)
        if self.rank == 0:
            atomic_write_text(self.run_dir / SAMPLES / f"step-{step:06d}.jsonl", "".join(x for r in every for x in r))

    # ------------------------------------------------------------------ resuming

    def state_dict(self) -> dict:
        """The rollout state and the counters, plus the batch being reused inside its μ steps: every
        rank's share of it (called on every rank; the checkpoint keeps the first rank's dict)."""
        reusing = self.uses_left > 0 or self.position > 0
        shares = self.gather([encode(mb) for mb in self.buffer] if reusing else None)
        return {"rollout": self.state.state_dict(), "drawn": self.drawn, "position": self.position,
                "uses_left": self.uses_left, "buffer": shares if reusing else None,
                "estimate": self.estimate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state["rollout"])
        self.drawn, self.position, self.uses_left = int(state["drawn"]), int(state["position"]), int(state["uses_left"])
        self.estimate.load_state_dict(state.get("estimate", {}))
        shares = state.get("buffer")
        if shares and len(shares) != self.dp:
            raise InputError(f"the checkpoint stopped inside a rollout batch sampled by {len(shares)} data-parallel "
                             f"ranks, this run has {self.dp}: resume it with {len(shares)}, or from a checkpoint at "
                             f"the end of a batch (grpo.updates_per_batch steps)")
        self.buffer = [decode(mb) for mb in shares[self.rank]] if shares else []


def minibatch_order(rows: list, minibatches: int) -> list:
    """The rows with minibatch i's (rows i, i + m, i + 2m, ... of ``minibatches`` m) together, in
    that order. Under torchrun each rank orders its own share so: a rank's rows start at a multiple
    of m of the global batch, so minibatch i holds the same rows on every layout of ranks (the
    global rows i mod m), and a 2-rank run's optimizer steps are one process's."""
    return [rows[j] for i in range(minibatches) for j in range(i, len(rows), minibatches)]


def encode(batch: dict[str, torch.Tensor]) -> dict:
    """A micro-batch as JSON (float32 values survive the round trip through Python floats exactly)."""
    return {k: [str(v.dtype).removeprefix("torch."), v.tolist()] for k, v in batch.items()}


def decode(batch: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(values, dtype=getattr(torch, dtype)) for k, (dtype, values) in batch.items()}
