"""Demo preference data from the verifiable SFT tasks (``lmforge.data.sft_demo``).

Every pair has a correct answer as ``chosen`` and an incorrect one as ``rejected``, so the
effect of alignment is measurable by exact match. The incorrect answer is, where one is
given, the SFT model's own wrong answer (``rejected_source: model``), else a plausible
mistake made by rule (``rejected_source: rule``): an arithmetic result a little off, a
count off by one, a reversal with two letters swapped, a list with two neighbours out of
order, a conversion with the wrong factor. KTO examples are the same pairs unpaired: the
chosen answer labelled desirable, the rejected one undesirable.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from lmforge.core.io import atomic_write_text
from lmforge.data.sft_demo import UNITS, exact_match


def rule_mistake(task: str, question: str, answer: str, rng: random.Random) -> str:
    """A wrong answer of the kind a model makes on ``task`` (never equal to ``answer``)."""
    if task in ("arithmetic", "counting"):
        value = int(answer)
        offsets = [-1, 1] if task == "counting" else [-10, -2, -1, 1, 2, 10]
        wrong = value + rng.choice(offsets)
        if task == "counting" and wrong < 0:
            wrong = value + 1
        return str(wrong)
    if task == "reversal":
        word = re.search(r"'([^']+)'", question).group(1)
        chars = list(answer)
        options = [i for i in range(len(chars) - 1) if chars[i] != chars[i + 1]]
        if options and rng.random() < 0.7:
            i = rng.choice(options)
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
            return "".join(chars)
        return word if word != answer else answer + answer[-1]
    if task == "sorting":
        numbers = answer.split(", ")
        options = [i for i in range(len(numbers) - 1) if numbers[i] != numbers[i + 1]]
        if not options:
            return ", ".join(numbers[:-1])
        i = rng.choice(options)
        numbers[i], numbers[i + 1] = numbers[i + 1], numbers[i]
        return ", ".join(numbers)
    if task == "unit_conversion":
        amount = int(re.search(r"are in (\d+) ", question).group(1))
        factors = sorted({f for _, _, f in UNITS} - {int(answer) // amount})
        return str(amount * rng.choice(factors))
    raise ValueError(f"unknown demo task {task!r}")


def make_pairs(examples: list[dict], model_answers: list[str | None] | None = None, seed: int = 0) -> list[dict]:
    """Conversational ``prompt``/``chosen``/``rejected`` pairs of SFT demo examples.

    ``model_answers[i]`` is the SFT model's answer to example i (None if not sampled); a
    wrong one becomes the rejected answer, else a rule-made mistake does.
    """
    rng = random.Random(seed)
    pairs = []
    for i, ex in enumerate(examples):
        messages = ex["messages"]
        question = messages[1]["content"]
        sampled = model_answers[i] if model_answers else None
        sampled = sampled.split("<|im_end|>", 1)[0].strip() if sampled is not None else None
        if sampled and not exact_match(sampled, ex["answer"]):
            rejected, source = sampled, "model"
        else:
            rejected, source = rule_mistake(ex["task"], question, ex["answer"], rng), "rule"
        pairs.append({"task": ex["task"], "rejected_source": source, "prompt": messages[:2],
                      "chosen": [{"role": "assistant", "content": ex["answer"]}],
                      "rejected": [{"role": "assistant", "content": rejected}]})
    return pairs


def unpair(pairs: list[dict]) -> list[dict]:
    """KTO examples: each pair's chosen answer (desirable) and rejected answer (undesirable)."""
    out = []
    for p in pairs:
        out.append({"task": p["task"], "prompt": p["prompt"], "completion": p["chosen"], "label": True})
        out.append({"task": p["task"], "prompt": p["prompt"], "completion": p["rejected"], "label": False,
                    "source": p["rejected_source"]})
    return out


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in rows))
