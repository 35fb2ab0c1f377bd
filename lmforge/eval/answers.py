"""Answer checks: is a model's text the expected answer? Plain functions of strings, shared by
``lmforge eval``'s metrics and the RL rewards (a verifiable reward is one of these checks).

- ``exact_match``: lm-evaluation-harness's ``exact_match`` on one pair (its
  ``exact_match_hf_evaluate``: ``regexes_to_ignore`` removed first, then case, punctuation and
  digits dropped as asked); ``strip_answer`` first applies the demo tasks' ``normalize_answer``
  (end-of-turn marker, surrounding whitespace, one trailing period).
- ``numeric_match``: the last number in the prediction equals the target's last number, within
  ``rel_tol`` (``math.isclose``); thousands separators, a leading ``$`` and exponents are read.
- ``final_answer``: the final answer of a worked response (GSM8K's ``####``, ``\\boxed{}``,
  ``answer:``), which the RL verifiers compare.
- ``edit_similarity``: partial credit, ``1 − lev(a, b) / max(|a|, |b|)`` with ``lev`` the
  Levenshtein distance in characters (1 for equal strings, 0 for nothing in common), after
  ``normalize_answer``: a dense reward where exact answers are rare.
- ``extract``: the harness's ``regex`` filter on one text (``findall``, the ``group``-th match,
  the first non-empty group of a match with several, stripped; ``fallback`` when none).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

from lmforge.data.chatml import IM_END
from lmforge.data.sft_demo import normalize_answer

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_DIGITS = str.maketrans("", "", string.digits)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def exact_match(prediction: str, target: str, *, ignore_case: bool = False, ignore_punctuation: bool = False,
                ignore_numbers: bool = False, regexes_to_ignore: Sequence[str] | None = None,
                strip_answer: bool = False) -> bool:
    """True when ``prediction`` equals ``target`` after the same normalisation of both, in the
    harness's order: each of ``regexes_to_ignore`` removed (``re.sub(r, "", s)``), lower-cased,
    ``string.punctuation`` removed, digits removed."""
    if strip_answer:
        prediction, target = normalize_answer(prediction), normalize_answer(target)
    for pattern in regexes_to_ignore or ():
        prediction, target = re.sub(pattern, "", prediction), re.sub(pattern, "", target)
    if ignore_case:
        prediction, target = prediction.lower(), target.lower()
    if ignore_punctuation:
        prediction, target = prediction.translate(_PUNCTUATION), target.translate(_PUNCTUATION)
    if ignore_numbers:
        prediction, target = prediction.translate(_DIGITS), target.translate(_DIGITS)
    return prediction == target


def edit_similarity(prediction: str, target: str) -> float:
    """``1 − lev(p, t) / max(|p|, |t|)`` of the normalised strings (``normalize_answer``): the share
    of characters that need no insertion, deletion or substitution; 1.0 when both are empty."""
    p, t = normalize_answer(prediction), normalize_answer(target)
    if not p and not t:
        return 1.0
    return 1.0 - levenshtein(p, t) / max(len(p), len(t))


def levenshtein(a: str, b: str) -> int:
    """The fewest single-character insertions, deletions and substitutions turning ``a`` into ``b``
    (Wagner-Fischer, one row at a time)."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def final_number(text: str) -> float | None:
    """The last number written in ``text`` (``-1,234.5`` -> -1234.5, ``$3`` -> 3, ``1e3`` -> 1000), or None."""
    found = NUMBER.findall(text.replace("$", ""))
    return float(found[-1].replace(",", "")) if found else None


def numeric_match(prediction: str, target: str | float | int, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> bool:
    """True when the last number in ``prediction`` is the target (a number, or the last number in
    the target's text) within ``math.isclose(rel_tol, abs_tol)``; False when either has none."""
    got = final_number(prediction)
    want = float(target) if isinstance(target, (int, float)) and not isinstance(target, bool) else final_number(str(target))
    if got is None or want is None:
        return False
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol)


def extract(text: str, regex: str | re.Pattern, group: int = 0, fallback: str | None = "[invalid]") -> str | None:
    """The ``group``-th match of ``regex`` in ``text`` (negative counts from the end), as the
    harness's ``regex`` filter picks it: a match of a pattern with several groups gives its
    first non-empty group; the result is stripped. ``fallback`` when nothing matches."""
    pattern = re.compile(regex) if isinstance(regex, str) else regex
    found = pattern.findall(text)
    if not found:
        return fallback
    match = found[group]
    if isinstance(match, tuple):
        match = next((m for m in match if m), fallback)
    return match.strip() if match is not None else None


def final_answer(text: str) -> str:
    """The final answer of a response: what follows the last ``####`` (GSM8K), else the content
    of the last ``\\boxed{...}``, else what follows the last ``answer:`` / ``answer is``, else
    the whole text; stripped, and cut at ``<|im_end|>``."""
    text = text.split(IM_END, 1)[0]
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    marked = re.split(r"(?i)\banswer(?:\s+is|:)", text)
    return (marked[-1] if len(marked) > 1 else text).strip()
