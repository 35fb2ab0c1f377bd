"""Demo SFT tasks with exact answers, so a fine-tuned model can be scored by exact match.

Five small task families (arithmetic, counting, string reversal, sorting, unit
conversion) rendered as ChatML ``messages`` with a system turn. The same seed gives the
same examples; the train/validation split is a stable hash of the question, so a
question never lands on both sides.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from lmforge.core.io import atomic_write_text
from lmforge.data.documents import split_of

SYSTEM_PROMPT = "Answer with the result only."
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lamp", "garden", "violin", "copper", "maple", "orbit", "pepper"]
UNITS = [("kilometres", "metres", 1000), ("metres", "centimetres", 100), ("kilograms", "grams", 1000),
         ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24)]


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(0, 1000), rng.randrange(0, 1000)
    op = rng.choice("+-*")
    if op == "*":
        a, b = a % 100, b % 100
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(result)


def counting(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcd") for _ in range(rng.randrange(5, 16)))
    letter = rng.choice("abcd")
    return f"How many times does the letter '{letter}' appear in '{word}'?", str(word.count(letter))


def reversal(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS) + rng.choice(WORDS)
    return f"Reverse the string '{word}'.", word[::-1]


def sorting(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randrange(0, 100) for _ in range(rng.randrange(3, 8))]
    return (f"Sort in ascending order: {', '.join(map(str, numbers))}.",
            ", ".join(map(str, sorted(numbers))))


def unit_conversion(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(UNITS)
    amount = rng.randrange(1, 50)
    return f"How many {small} are in {amount} {big}?", str(amount * factor)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": arithmetic, "counting": counting, "reversal": reversal,
    "sorting": sorting, "unit_conversion": unit_conversion,
}


def make_examples(n: int, seed: int = 0, tasks: list[str] | None = None) -> list[dict]:
    """``n`` distinct examples ``{"task", "answer", "messages"}``, cycling through ``tasks`` in order."""
    names = tasks or list(TASKS)
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown demo tasks {unknown}; choose from {list(TASKS)}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot make {n} distinct examples of tasks {names}")
        name = names[len(out) % len(names)]
        question, answer = TASKS[name](rng)
        if question in seen:
            continue
        seen.add(question)
        out.append({"task": name, "answer": answer, "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]})
    return out


def split_examples(examples: list[dict], val_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """(train, val) by a stable hash of each question."""
    train, val = [], []
    for ex in examples:
        (val if split_of(ex["messages"][1]["content"], val_fraction) == "val" else train).append(ex)
    return train, val


def write_demo(directory: str | Path, n: int, seed: int = 0, val_fraction: float = 0.1) -> dict[str, int]:
    """Write ``train.jsonl`` and ``val.jsonl`` into ``directory``; returns the example counts."""
    train, val = split_examples(make_examples(n, seed), val_fraction)
    for name, rows in (("train", train), ("val", val)):
        atomic_write_text(Path(directory) / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return {"train": len(train), "val": len(val)}


def normalize_answer(text: str) -> str:
    """Strip an end-of-turn marker, surrounding whitespace and one trailing period; collapse spaces."""
    text = text.split("<|im_end|>", 1)[0].strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return " ".join(text.split())


def exact_match(prediction: str, answer: str) -> bool:
    """True when the prediction is the answer, up to whitespace, a trailing period and ``<|im_end|>``."""
    return normalize_answer(prediction) == normalize_answer(answer)
