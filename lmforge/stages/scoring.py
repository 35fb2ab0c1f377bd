"""Scorers of a fine-tuned model, scored on the whole model by rank 0 before and after training
(``stages.finetune``): a recipe's named scorer (``score.name``) and the stages' own measures.

A scorer is read while every rank reads its data (so an input error in it stops all ranks
alike) and is then a function of the model alone: ``Scorer(model) -> dict`` of figures.

- ``exact_match``: greedy answers to task prompts compared with the reference answers (the
  demo's exact-answer tasks, ``data.sft_demo``); chosen by ``score: {name: exact_match}``,
  off by default.
- ``pairwise_preference``: how often the model itself gives the chosen completion the higher
  log-probability (dpo's validation pairs, kto's held-out ``pairs:``).
- ``held_out_scores``: one policy's greedy answers to held-out prompts, scored the ways every
  alignment method can be compared on (``benchmarks/alignment.py``): exact match, a reward's
  mean (the demo reward model's) and the exact KL to a reference model along the answers.
- ``eval_tasks_scorer``: ``lmforge eval``'s tasks and suites (``train.eval_tasks``), which the
  training loop scores every ``eval_every`` steps, as ``eval/<task>/<metric>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lmforge.core.config import Renamed, at_least, option, positive
from lmforge.data.chat import chat_prompt_ids, read_sft_records
from lmforge.data.sft_demo import exact_match
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.evaluate import EvalSettings, MetricResult
from lmforge.eval.suite import evaluate_all, load_tasks
from lmforge.inference.engine import GenerationConfig, generate, release_decoding_view
from lmforge.model.reward import model_inputs
from lmforge.objectives.reference import completion_logprobs
from lmforge.rl.kl import exact_kl
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import Reward
from lmforge.rl.rollout import Rollout, RolloutConfig, RolloutState, rollout_batch, sample_rollouts
from lmforge.train.loop import autocast_context

Scorer = Callable[[nn.Module], dict]


@dataclass
class ScoreConfig:
    """The recipe's ``score:`` section: a named scorer and what it reads."""

    name: Literal["none", "exact_match"] = option(
        "none", help="exact_match: greedy answers compared with the reference answers"
    )
    tasks: list[str] = option(default_factory=list, help="files of tasks to score; empty: the validation data")
    max_examples: int = at_least(0, 200, help="the first this many examples are scored")
    max_new_tokens: int = positive(32, help="the longest greedy answer")

    def files(self, val: list[str]) -> list[str]:
        """The task files the scorer reads: ``score.tasks``, else the validation data (none without a scorer)."""
        return (self.tasks or val) if self.name != "none" else []


# the score section's keys before it was one (their old default, exact match on, is now score.name: exact_match)
RENAMED_EVAL_KEYS = {
    "eval.exact_match": Renamed("score.name", {True: "exact_match", False: "none"}),
    "eval.tasks": Renamed("score.tasks"),
    "eval.max_examples": Renamed("score.max_examples"),
    "eval.max_new_tokens": Renamed("score.max_new_tokens"),
}


def named_scorer(cfg: ScoreConfig, tok: Tokenizer, val: list[str]) -> Scorer | None:
    """The recipe's scorer (None for ``score.name: none``), its tasks read now."""
    if cfg.name == "none":
        return None
    prompts, answers, tasks = exact_match_tasks(tok, cfg.files(val), cfg.max_examples)
    return lambda model: {"exact_match": exact_match_accuracy(model, tok, prompts, answers, cfg.max_new_tokens, tasks)}


def combined(*scorers: Scorer | None) -> Scorer | None:
    """One scorer of the figures of every given one (None if none is given)."""
    given = [s for s in scorers if s is not None]
    if not given:
        return None
    return lambda model: {key: value for scorer in given for key, value in scorer(model).items()}


def exact_match_tasks(tok: Tokenizer, paths: list[str],
                      max_examples: int) -> tuple[list[list[int]], list[str], list[str | None]]:
    """Prompts (ChatML up to the generation prompt), reference answers and ``task`` fields (None
    where a record has none) of conversations ending with the assistant, of conversational
    ``prompt``/``chosen`` pairs (the chosen answer), or of desirable ``prompt``/``completion`` examples."""
    prompts: list[list[int]] = []
    answers: list[str] = []
    tasks: list[str | None] = []
    if not paths:
        return prompts, answers, tasks
    for _, record in read_sft_records(paths):
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("messages"), list) and record["messages"]:
            context, answer = record["messages"][:-1], record["messages"][-1]
        elif isinstance(record.get("prompt"), list) and isinstance(record.get("chosen"), list) and record["chosen"]:
            context, answer = record["prompt"], record["chosen"][-1]
        elif (isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), list)
              and record["completion"] and record.get("label", True) is True):
            context, answer = record["prompt"], record["completion"][-1]
        else:
            continue
        if not isinstance(answer, dict) or answer.get("role") != "assistant":
            continue
        prompts.append(chat_prompt_ids(tok, context))
        answers.append(answer["content"])
        tasks.append(record["task"] if isinstance(record.get("task"), str) else None)
        if len(prompts) >= max_examples:
            break
    return prompts, answers, tasks


def exact_match_accuracy(model: nn.Module, tok: Tokenizer, prompts: list[list[int]], answers: list[str],
                         max_new_tokens: int, tasks: list[str | None] | None = None) -> dict | None:
    """Greedy answers to the prompts, scored by exact match against the references (greedy decoding
    draws no random numbers, so scoring on rank 0 alone leaves every rank's generator the same).
    With ``tasks`` (each prompt's task name, or None), also ``correct/<task>`` and ``count/<task>``:
    how many of each task's prompts are answered right, of how many."""
    if not prompts:
        return None
    was_training = model.training
    model.eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                           stop_token_ids=[tok.token_to_id("<|im_end|>"), tok.eos_id])
    right: list[bool] = []
    for i in range(0, len(prompts), 32):
        results = generate(model, prompts[i : i + 32], gen, tok)
        right += [exact_match(r.text, a) for r, a in zip(results, answers[i : i + 32])]
    release_decoding_view(model)  # training may follow: don't hold a second copy of the weights through it
    model.train(was_training)
    out = {"exact_match": sum(right) / len(prompts), "examples": len(prompts)}
    for task in sorted({t for t in tasks or [] if t is not None}):
        of_task = [ok for ok, t in zip(right, tasks) if t == task]
        out[f"correct/{task}"], out[f"count/{task}"] = sum(of_task), len(of_task)
    return out


def task_changes(before: dict, after: dict) -> str:
    """``counting 3 -> 5 of 19, sorting 0 -> 0 of 15``: each task's right answers in two
    ``exact_match_accuracy`` results ('' when they were not counted by task)."""
    names = sorted(k.removeprefix("count/") for k in after if k.startswith("count/") and k in before)
    return ", ".join(f"{n} {before[f'correct/{n}']} → {after[f'correct/{n}']} of {after[f'count/{n}']}" for n in names)


def preference_scorer(rows: dict[str, torch.Tensor], batch_size: int, device: torch.device,
                      precision: str) -> Scorer:
    """``pairwise_preference`` on ``rows`` (``pair_rows``) as a scorer."""
    return lambda model: pairwise_preference(model, rows, batch_size, device, precision)


@torch.no_grad()
def pairwise_preference(model: nn.Module, rows: dict[str, torch.Tensor], batch_size: int,
                        device: torch.device, precision: str) -> dict:
    """How often the model itself prefers chosen: logπ(chosen) > logπ(rejected), summed and
    length-averaged, and the mean summed log-prob margin. Comparable across every loss."""
    was_training = model.training
    model.eval()
    scores = {}
    try:
        for side in ("chosen", "rejected"):
            sums, counts = [], []
            for start in range(0, len(rows[f"{side}_input_ids"]), batch_size):
                cols = slice(start, start + batch_size)
                with autocast_context(device, precision):
                    s, n = completion_logprobs(model, rows[f"{side}_input_ids"][cols].to(device),
                                               rows[f"{side}_labels"][cols].to(device),
                                               rows[f"{side}_attention_mask"][cols].to(device))[:2]
                sums.append(s.float().cpu())
                counts.append(n.cpu())
            scores[side] = (torch.cat(sums), torch.cat(counts).clamp(min=1))
    finally:
        model.train(was_training)
    (c, nc), (r, nr) = scores["chosen"], scores["rejected"]
    return {"pairs": len(c), "logp_accuracy": float((c > r).float().mean()),
            "avg_logp_accuracy": float((c / nc > r / nr).float().mean()), "logp_margin": float((c - r).mean())}


@torch.no_grad()
def held_out_scores(model: nn.Module, tok: Tokenizer, prompts: list[Prompt], max_new_tokens: int, *,
                    reward: Reward | None = None, reference: nn.Module | None = None, batch_size: int = 32) -> dict:
    """``model``'s greedy answers to ``prompts`` (through the rollout engine, stopping as the
    stages' scorers do), scored by: ``exact_match`` against each prompt's reference answer (the
    demo checker, as ``exact_match_accuracy``), ``reward_mean`` of ``reward`` (e.g. a reward
    model) and, with a ``reference``, ``kl_per_token`` and ``kl_per_sequence`` (``answer_kl``)."""
    greedy = RolloutConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens, shuffle=False)
    groups = sample_rollouts(model, tok, prompts, greedy, RolloutState(0, len(prompts), shuffle=False), len(prompts))
    release_decoding_view(model)
    rollouts = [g[0] for g in groups]
    scored = [r for r in rollouts if r.prompt.reference is not None]
    out = {"examples": len(rollouts), "response_length_mean": sum(len(r.response_ids) for r in rollouts) / len(rollouts)}
    if scored:
        out["exact_match"] = sum(exact_match(r.text, r.prompt.reference) for r in scored) / len(scored)
    if reward is not None:
        out["reward_mean"] = sum(reward(rollouts).total) / len(rollouts)
    if reference is not None:
        out |= answer_kl(model, reference, rollouts, tok.pad_id, batch_size)
    return out


@torch.no_grad()
def answer_kl(model: nn.Module, reference: nn.Module, rollouts: list[Rollout], pad_id: int,
              batch_size: int = 32) -> dict:
    """KL(π ‖ π_ref) along the responses, exact at each response token (``rl.kl.exact_kl``, summed over
    the vocabulary, in float32): ``kl_per_token`` the mean over responses of each one's per-token
    mean, ``kl_per_sequence`` the mean over responses of each one's sum."""
    per_token, per_sequence = [], []
    device = next(model.parameters()).device
    was = model.training, reference.training
    model.eval(), reference.eval()
    try:
        for start in range(0, len(rollouts), batch_size):
            batch = rollout_batch(rollouts[start : start + batch_size], pad_id)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            logits = model(ids, **model_inputs(ids, mask))[:, :-1]
            ref_logits = reference(ids, **model_inputs(ids, mask))[:, :-1]
            on = batch["response_mask"][:, 1:].to(device).float()
            kl = (exact_kl(logits, ref_logits) * on).sum(-1).cpu()
            per_sequence += kl.tolist()
            per_token += (kl / on.sum(-1).clamp(min=1).cpu()).tolist()
    finally:
        model.train(was[0]), reference.train(was[1])
    return {"kl_per_token": sum(per_token) / len(per_token), "kl_per_sequence": sum(per_sequence) / len(per_sequence)}


def eval_tasks_scorer(specs: list[str], tok: Tokenizer, batch_size: int = 16) -> Scorer | None:
    """A scorer of ``lmforge eval``'s tasks (files, suites, bundled names), read now so that a bad
    task stops the stage before training; None without tasks. Scored in float32 without autocast
    (as ``lmforge eval`` scores), in eval mode, without bootstrapped stderrs."""
    if not specs:
        return None
    tasks, suites = load_tasks(specs)
    settings = EvalSettings(bootstrap_iters=0, batch_size=batch_size)

    def score(model: nn.Module) -> dict:
        was_training = model.training
        model.eval()
        try:
            results = evaluate_all(tasks, suites, model, tok, settings)
        finally:
            release_decoding_view(model)  # generation's view of the weights: not held through training
            model.train(was_training)
        return {metric_key(r): r.value for r in results}

    return score


def metric_key(r: MetricResult) -> str:
    """``eval/<task>/<metric>``, and ``/<filter>`` for a named filter of a generation task."""
    return f"eval/{r.task}/{r.metric}" + ("" if r.filter == "none" else f"/{r.filter}")
