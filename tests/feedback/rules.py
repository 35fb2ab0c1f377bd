"""Rule-based judges and critics with known preferences, for `judge.function` in the tests."""

from __future__ import annotations

from lmforge.feedback.judges import Chat, Comparison

CALLS = {"n": 0}


def shorter(c: Comparison) -> float:
    """Prefers the shorter response, surely; no position bias."""
    CALLS["n"] += 1
    return 1.0 if len(c.a) < len(c.b) else 0.0 if len(c.a) > len(c.b) else 0.5


def biased(c: Comparison) -> float:
    """Prefers the shorter response, but leans to (A): P(A) = 0.75 + 0.2 * (+1 A shorter, -1 longer, 0)."""
    s = (len(c.a) < len(c.b)) - (len(c.a) > len(c.b))
    return 0.75 + 0.2 * s


def says_a(c: Comparison) -> str:
    """Always answers (A) as text: a parsed choice that only position decides."""
    return "I choose (A)."


def neither(c: Comparison) -> str:
    return "Both are fine."


def critic(chat: Chat) -> str:
    """Critiques by quoting the response; revises to its first three characters."""
    response = chat.messages[-2]["content"] if chat.key.endswith("critique") else chat.messages[-4]["content"]
    return f"'{response}' is too long" if chat.key.endswith("critique") else response[:3]


def mute(chat: Chat) -> str:
    """A critic with nothing to say (its revisions must never be asked for)."""
    assert chat.key.endswith("critique"), chat.key
    return ""


def raises(item: Chat | Comparison) -> float:
    """A rule with a bug."""
    raise RuntimeError("the rule broke")
