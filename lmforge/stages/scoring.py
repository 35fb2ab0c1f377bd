"""Scorers of a fine-tuned model, scored on the whole model by rank 0 before and after training
(``stages.finetune``): a recipe's named scorer (``score.name``) and the stages' own measures.

A scorer is read while every rank reads its data (so an input error in it stops all ranks
alike) and is then a function of the model alone: ``Scorer(model) -> dict`` of figures.

- ``exact_match``: greedy answers to task prompts compared with the reference answers (the
  demo's exact-answer tasks, ``data.sft_demo``); chosen by ``score: {name: exact_match}``,
  off by default.
- ``pairwise_preference``: how often the model itself gives the chosen completion the higher
  log-probability (dpo's validation pairs, kto's held-out ``pairs:``).
- ``eval_tasks_scorer``: ``lmforge eval``'s tasks and suites (``train.eval_tasks``), which the
  training loop scores every ``eval_every`` steps, as ``eval/<task>/<metric>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lmforge.core.config import Renamed, at_least, positive
from lmforge.data.chat import chat_prompt_ids, read_sft_records
from lmforge.data.sft_demo import exact_match
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.evaluate import EvalSettings, MetricResult
from lmforge.eval.suite import evaluate_all, load_tasks
from lmforge.inference.engine import GenerationConfig, generate, release_decoding_view
from lmforge.objectives.reference import completion_logprobs
from lmforge.train.loop import autocast_context

Scorer = Callable[[nn.Module], dict]


@dataclass
class ScoreConfig:
    """The recipe's ``score:`` section: a named scorer and what it reads."""

    name: Literal["none", "exact_match"] = "none"  # exact_match: greedy answers compared with the reference answers
    tasks: list[str] = field(default_factory=list)  # files of tasks to score; empty: the validation data
    max_examples: int = at_least(0, 200)
    max_new_tokens: int = positive(32)

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
    prompts, answers = exact_match_tasks(tok, cfg.files(val), cfg.max_examples)
    return lambda model: {"exact_match": exact_match_accuracy(model, tok, prompts, answers, cfg.max_new_tokens)}


def combined(*scorers: Scorer | None) -> Scorer | None:
    """One scorer of the figures of every given one (None if none is given)."""
    given = [s for s in scorers if s is not None]
    if not given:
        return None
    return lambda model: {key: value for scorer in given for key, value in scorer(model).items()}


def exact_match_tasks(tok: Tokenizer, paths: list[str], max_examples: int) -> tuple[list[list[int]], list[str]]:
    """Prompts (ChatML up to the generation prompt) and reference answers of conversations ending
    with the assistant, of conversational ``prompt``/``chosen`` pairs (the chosen answer), or of
    desirable ``prompt``/``completion`` examples."""
    prompts: list[list[int]] = []
    answers: list[str] = []
    if not paths:
        return prompts, answers
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
        if len(prompts) >= max_examples:
            break
    return prompts, answers


def exact_match_accuracy(model: nn.Module, tok: Tokenizer, prompts: list[list[int]], answers: list[str],
                         max_new_tokens: int) -> dict | None:
    """Greedy answers to the prompts, scored by exact match against the references (greedy decoding
    draws no random numbers, so scoring on rank 0 alone leaves every rank's generator the same)."""
    if not prompts:
        return None
    was_training = model.training
    model.eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                           stop_token_ids=[tok.token_to_id("<|im_end|>"), tok.eos_id])
    correct = 0
    for i in range(0, len(prompts), 32):
        results = generate(model, prompts[i : i + 32], gen, tok)
        correct += sum(exact_match(r.text, a) for r, a in zip(results, answers[i : i + 32]))
    release_decoding_view(model)  # training may follow: don't hold a second copy of the weights through it
    model.train(was_training)
    return {"exact_match": correct / len(prompts), "examples": len(prompts)}


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
