"""AI preference labels (RL-CAI, Bai et al. 2022, section 4.1), balanced over the two orders.

The judge sees a principle's comparison question with two responses as options (A) and (B).
Its soft label is the normalised probability of the two options at its answer token:

    P(A) = p("A") / (p("A") + p("B"))

where p("A") sums the probabilities of the alternatives at that position that read "A"
(``A``, `` A``, ``(A``, ``A)``...), and likewise for "B" (``choice_probability``). The answer
token is the first generated token that reads A or B, else the first that reads anything (an
opening "(" is skipped). An option outside the judge's ``top_logprobs`` alternatives counts
as probability 0. When the backend gives no log-probs, or neither option is among them, the
label is the choice its text names, "(A)" or "(B)" (or a bare "A", "Option B", "Answer: A"):
1 or 0. A text naming neither (or both)
has no label: a ``NoChoice`` (an error naming the item, or a counted skip).

Each pair (x, y) is judged in both orders, (A, B) = (x, y) and (y, x), and

    P(x > y) = (P_1(A) + (1 - P_2(A))) / 2

cancels a judge's preference for a position. The two orders *disagree* when one prefers x
and the other y (or one has no preference and the other has): the disagreement rate measures
the position bias that averaging removes. The pair becomes ``chosen``/``rejected`` with
``confidence = max(P, 1 - P)`` in [0.5, 1]; a pair with confidence below the threshold, or
exactly 0.5 (no preference), is dropped and counted. Its ``margin`` is the Bradley-Terry
log-odds of the confidence, ``log(c / (1 - c))`` (capped at ``MAX_MARGIN``): the gap of
rewards under which a Bradley-Terry model gives that probability, what ``lmforge reward``'s
``use_margin`` (Llama 2's margin loss) reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from lmforge.feedback.judges import Answer, Comparison, Judge, JudgeError

MAX_MARGIN = math.log((1 - 1e-4) / 1e-4)  # the margin of confidence 0.9999: a sure label stays finite
OPTION = re.compile(r"\(([AB])\)")
NAMED = re.compile(r"\b(?:option|answer(?: is)?|choice)\s*:?\s*\(?([AB])\b", re.IGNORECASE)


class NoChoice(JudgeError):
    """A judge's answer that names neither option (A) nor (B), or both."""


def option_of(text: str) -> str | None:
    """"A" or "B" when a token's text reads as that option (``A``, `` (B``, ``A)``), else None."""
    core = text.strip().strip("()[].:").strip()
    return core if core in ("A", "B") else None


def answer_position(answer: Answer) -> int | None:
    """The answer token: the first that reads A or B, else the first with any text besides "(" and spaces."""
    tokens = answer.tokens or []
    for i, t in enumerate(tokens):
        if option_of(t.text):
            return i
    for i, t in enumerate(tokens):
        if t.text.strip().lstrip("(").strip():
            return i
    return None


def parsed_choice(text: str) -> str | None:
    """The option a text names: exactly one of "(A)"/"(B)"; else the text is "A" or "B"; else
    exactly one of "option A", "answer: B", "choice A"..."""
    named = set(OPTION.findall(text))
    if len(named) == 1:
        return named.pop()
    if named:
        return None
    if option_of(text):
        return option_of(text)
    named = set(NAMED.findall(text))
    return named.pop() if len(named) == 1 else None


def choice_probability(answer: Answer) -> tuple[float | None, str]:
    """P(A) of one answer and how it was read: ``callable``, ``logprobs``, ``parsed``, or (None, ``no_choice``)."""
    if answer.p_a is not None:
        return answer.p_a, "callable"
    position = answer_position(answer)
    if position is not None:
        token = answer.tokens[position]
        best: dict[str, float] = {}
        for text, logprob in [*token.top, (token.text, token.logprob)]:  # one probability per distinct text
            best[text] = max(best.get(text, -math.inf), logprob)
        mass = {"A": 0.0, "B": 0.0}
        for text, logprob in best.items():
            option = option_of(text)
            if option:
                mass[option] += math.exp(logprob)
        if mass["A"] + mass["B"] > 0:
            return mass["A"] / (mass["A"] + mass["B"]), "logprobs"
    choice = parsed_choice(answer.text)
    if choice is None:
        return None, "no_choice"
    return (1.0 if choice == "A" else 0.0), "parsed"


def preference(p: float) -> int:
    """+1 when the first response is preferred, -1 when the second, 0 for no preference."""
    return (p > 0.5) - (p < 0.5)


@dataclass(frozen=True)
class PairToJudge:
    """Responses ``x`` and ``y`` to ``prompt`` (their sample numbers ``ix`` < ``iy``), under one principle."""

    key: str  # names the pair: the prompt's file:line and the sample numbers
    prompt: str | list[dict]
    x: str
    y: str
    ix: int
    iy: int
    principle: str
    question: str


def judge_pairs(judge: Judge, pairs: Sequence[PairToJudge], on_no_choice: str = "error") -> list[dict]:
    """Each pair judged in both orders (one batch of 2 x len(pairs) comparisons), as the
    records ``cai label`` stores: both orders' P(x first) and how they were read, the answers,
    the balanced P(x > y), whether the orders disagree, or ``skipped`` with the reason."""
    comparisons = []
    for p in pairs:
        comparisons.append(Comparison(f"{p.key} (x, y)", p.prompt, p.x, p.y, p.question))
        comparisons.append(Comparison(f"{p.key} (y, x)", p.prompt, p.y, p.x, p.question))
    answers = judge.compare(comparisons)
    if len(answers) != len(comparisons):
        raise JudgeError(f"the judge answered {len(answers)} of {len(comparisons)} comparisons")
    out = []
    for i, p in enumerate(pairs):
        (p1, how1), (p2, how2) = choice_probability(answers[2 * i]), choice_probability(answers[2 * i + 1])
        record = {"samples": [p.ix, p.iy], "principle": p.principle, "answers": [answers[2 * i].text,
                                                                                answers[2 * i + 1].text],
                  "read": [how1, how2]}
        if p1 is None or p2 is None:
            order = "(x, y)" if p1 is None else "(y, x)"
            if on_no_choice == "error":
                text = answers[2 * i].text if p1 is None else answers[2 * i + 1].text
                raise NoChoice(f"{p.key} {order}: the judge's answer names neither (A) nor (B): {text[:120]!r} (set "
                               "label.on_no_choice=skip to skip and count such pairs)")
            out.append({**record, "skipped": "no_choice"})
            continue
        first, second = p1, 1.0 - p2  # P(x preferred), from each order
        record.update(p_x=[first, second], p_x_better=(first + second) / 2,
                      disagree=preference(first) != preference(second))
        out.append(record)
    return out


def pair_output(prompt: str | list[dict], x: str, y: str, judged: dict, threshold: float
                ) -> tuple[dict | None, str]:
    """The ``prompt``/``chosen``/``rejected`` record of a judged pair, or None, and why (``kept`` or the drop)."""
    if "skipped" in judged:
        return None, judged["skipped"]
    p = judged["p_x_better"]
    if p == 0.5:
        return None, "no_preference"
    confidence = max(p, 1.0 - p)
    if confidence < threshold:
        return None, "below_threshold"
    chosen, rejected = (x, y) if p > 0.5 else (y, x)
    if isinstance(prompt, list):
        chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    margin = min(math.log(confidence / (1.0 - confidence)) if confidence < 1.0 else math.inf, MAX_MARGIN)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "confidence": confidence,
            "margin": margin}, "kept"
