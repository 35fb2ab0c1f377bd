"""Demo SFT tasks with exact answers, so a fine-tuned model can be scored by exact match.

Five small task families (arithmetic, counting, string reversal, sorting, unit
conversion) rendered as ChatML ``messages`` with a system turn. The same seed gives the
same examples; the train/validation split is a stable hash of the question, so a
question never lands on both sides.
"""

from __future__ import annotations

import json
import random
import re
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


def make_examples(n: int, seed: int = 0, tasks: list[str] | None = None, patience: int = 1000) -> list[dict]:
    """``n`` distinct examples ``{"task", "answer", "messages"}``, cycling through ``tasks`` in order.

    A task that has run out of new questions (``patience`` draws in a row that repeat one
    already made) leaves the cycle and the others go on, so ``n`` may exceed what the small
    tasks hold: reversal has 144 questions, unit conversion 294."""
    names = tasks or list(TASKS)
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown demo tasks {unknown}; choose from {list(TASKS)}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    active = list(names)
    turn = 0
    while len(out) < n:
        if not active:
            raise ValueError(f"cannot make {n} distinct examples of tasks {names}: they hold {len(out)}")
        name = active[turn % len(active)]
        for _ in range(patience):
            question, answer = TASKS[name](rng)
            if question not in seen:
                break
        else:
            active.remove(name)  # exhausted: the next task takes this turn
            continue
        seen.add(question)
        turn += 1
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


def write_demo(directory: str | Path, n: int, seed: int = 0, val_fraction: float = 0.1,
               max_val: int | None = None) -> dict[str, int]:
    """Write ``train.jsonl`` and ``val.jsonl`` into ``directory``; returns the example counts.
    ``max_val`` keeps only the first that many validation examples: the rest of the validation
    side is left out of both files (never trained on), so a large training set can keep a small,
    fixed held-out set (the same first ones for any ``n``, as examples come in a fixed order)."""
    train, val = split_examples(make_examples(n, seed), val_fraction)
    val = val if max_val is None else val[:max_val]
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


# --------------------------------------------------------------------------- multiple-choice versions


def distractors(task: str, question: str, answer: str, n: int = 3) -> list[str]:
    """``n`` wrong answers to one of the tasks' questions, made by the task's own rules so that
    each is a near miss: arithmetic, the other operations on the same numbers and the answer off by
    1 or 10; counting, off by one or two (never negative); unit conversion, the amount times another
    of the tasks' factors, or off by one unit; reversal, the word as given, and two letters swapped;
    sorting, descending, as given, and two neighbours swapped. The same question always gives the
    same list (a ``random.Random`` seeded by the question only draws which near misses are used)."""
    rng = random.Random(f"distractors:{question}")
    candidates = _near_misses(task, question, answer, rng)
    out: list[str] = []
    for c in candidates:
        if c != answer and c not in out:
            out.append(c)
    if len(out) < n:
        raise ValueError(f"{task}: only {len(out)} distinct distractors for {question!r} (answer {answer!r})")
    return out[:n]


def _near_misses(task: str, question: str, answer: str, rng: random.Random) -> list[str]:
    if task == "arithmetic":
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
        a, b = int(a), int(b)
        others = [str(v) for o, v in (("+", a + b), ("-", a - b), ("*", a * b)) if o != op]
        offsets = [str(int(answer) + d) for d in rng.sample([-10, -1, 1, 10], 4)]
        return [*others, *offsets]
    if task == "counting":
        count = int(answer)
        return [str(count + d) for d in rng.sample([-2, -1, 1, 2], 4) if count + d >= 0] + [str(count + 3)]
    if task == "unit_conversion":
        amount = int(re.fullmatch(r"How many \w+ are in (\d+) \w+\?", question).group(1))
        factors = sorted({f for _, _, f in UNITS})
        rng.shuffle(factors)
        factor = int(answer) // amount
        return [str(amount * f) for f in factors] + [str(int(answer) + factor), str(int(answer) - factor)]
    if task == "reversal":
        word = re.fullmatch(r"Reverse the string '(\w+)'\.", question).group(1)
        swaps = [_swapped(answer, i) for i in rng.sample(range(len(answer) - 1), len(answer) - 1)]
        return [word, *swaps]
    if task == "sorting":
        numbers = [int(x) for x in re.fullmatch(r"Sort in ascending order: ([\d, ]+)\.", question).group(1).split(", ")]
        ordered = sorted(numbers)
        swaps = [_swapped(ordered, i) for i in rng.sample(range(len(ordered) - 1), len(ordered) - 1)]
        return [", ".join(map(str, x)) for x in (sorted(numbers, reverse=True), numbers, *swaps)]
    raise ValueError(f"unknown demo task {task!r}; choose from {list(TASKS)}")


def _swapped(items, i: int):
    """``items`` (a string or list) with positions ``i`` and ``i + 1`` exchanged."""
    out = list(items)
    out[i], out[i + 1] = out[i + 1], out[i]
    return "".join(out) if isinstance(items, str) else out


def choice_example(example: dict, n_choices: int = 4, end: str = "<|im_end|>") -> dict:
    """A multiple-choice version of a demo example: its answer among ``n_choices - 1`` distractors
    at a position drawn from the question, each choice followed by ``end`` (so that a choice that
    is a prefix of another, 12 and 123, is not favoured: each must end the turn)."""
    question = example["messages"][1]["content"]
    options = distractors(example["task"], question, example["answer"], n_choices - 1)
    label = random.Random(f"label:{question}").randrange(n_choices)
    options.insert(label, example["answer"])
    return {"task": example["task"], "system": example["messages"][0]["content"], "question": question,
            "answers": options, "choices": [o + end for o in options], "label": label}
