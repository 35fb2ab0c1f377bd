"""Heuristic quality filters: URL blocklist, Gopher quality and repetition, C4 and FineWeb.

Every threshold defaults to the value in datatrove (``src/datatrove/pipeline/filters/``,
v0.10), which FineWeb ran with, and every one can be changed in the recipe; ``null``
turns a rule off. A filter returns ``None`` to keep a document or a reason
``"<rule>: <measured value> <op> <threshold>"``; the rule names are datatrove's.

Words come from :func:`split_words`, one documented regex instead of datatrove's spaCy
tokenizer, so counts differ slightly from datatrove's on contractions ("don't" is one
word here, two in spaCy) but not on ordinary prose.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lmforge.core.config import Range, at_least, option, positive, unit_interval
from lmforge.core.io import InputError
from lmforge.data.documents import Document

# A word is a run of letters/digits/underscore, keeping inner apostrophes, dots and hyphens
# ("don't", "e.g", "well-known", "3.14"); any other run of non-space characters is one
# symbol token ("...", "#", "--"), as spaCy keeps punctuation as tokens.
WORD_RE = re.compile(r"\w+(?:['’.\-]\w+)*|[^\w\s]+")


def split_words(text: str) -> list[str]:
    """Words and symbol tokens of ``text``, in order (see ``WORD_RE``)."""
    return WORD_RE.findall(text)


def is_symbol(token: str) -> bool:
    """A token without any letter, digit or underscore (datatrove: all chars in PUNCTUATION_SET)."""
    return not (token[0].isalnum() or token[0] == "_")


def _over(name: str, value: float, limit: float | None) -> str | None:
    return f"{name}: {value:.3g} > {limit:g}" if limit is not None and value > limit else None


def _under(name: str, value: float, limit: float | None) -> str | None:
    return f"{name}: {value:.3g} < {limit:g}" if limit is not None and value < limit else None


# --------------------------------------------------------------------------- URL blocklist


@dataclass
class UrlFilterConfig:
    """Block documents by URL: blocked domains (and their subdomains) and banned words.

    datatrove's ``URLFilter`` downloads an 18 MB adult-site list; here the lists come from
    the recipe or from local files (one entry per line, ``#`` starts a comment).
    """

    domains: list[str] = option(
        default_factory=list, help="blocked domains, each with its subdomains ([example.com] also blocks a.example.com)"
    )
    domains_file: str | None = option(
        None, help="a file of more blocked domains, one per line (blank lines and lines starting with # are skipped)"
    )
    banned_words: list[str] = option(
        default_factory=list,
        help="a URL with one of these as a whole word (the URL split on non-alphanumerics) is blocked",
    )
    banned_words_file: str | None = option(
        None, help="a file of more banned words, one per line (blank lines and lines starting with # are skipped)"
    )
    soft_banned_words: list[str] = option(
        default_factory=list, help="a URL with soft_word_threshold or more of these as whole words is blocked"
    )
    soft_word_threshold: int = at_least(
        1, 2, help="how many distinct soft-banned words block a URL (datatrove: 2)"
    )
    banned_subwords: list[str] = option(
        default_factory=list,
        help="a URL that contains one of these once the non-alphanumerics of both are removed is blocked",
    )
    missing_url: str = option("keep", help="keep or reject the documents without metadata url")

    def __post_init__(self) -> None:
        if self.missing_url not in ("keep", "reject"):
            raise ValueError(f"missing_url must be 'keep' or 'reject', got {self.missing_url!r}")

    def check_inputs(self, where: str) -> None:
        """Before any work (``run_curate``): the list files read; the error names the key (``where``:
        the step, as ``steps[2]``) and the file, rather than a worker's traceback."""
        for key in ("domains_file", "banned_words_file"):
            try:
                _read_list(getattr(self, key))
            except InputError as exc:
                raise InputError(f"{where}.{key}: {exc}") from exc


_URL_SPLIT = re.compile(r"[^a-zA-Z0-9]+")


def _read_list(path: str | None) -> list[str]:
    if path is None:
        return []
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"{p}: cannot read blocklist: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{p}: blocklist is not valid UTF-8 (byte {exc.start})") from exc
    return [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]


class UrlFilter:
    name = "url_filter"

    def __init__(self, cfg: UrlFilterConfig):
        self.cfg = cfg
        self.domains = {d.lower().strip(".") for d in cfg.domains + _read_list(cfg.domains_file)}
        self.banned = {w.lower() for w in cfg.banned_words + _read_list(cfg.banned_words_file)}
        self.soft = {w.lower() for w in cfg.soft_banned_words}
        self.subwords = [_URL_SPLIT.sub("", w).lower() for w in cfg.banned_subwords]

    def __call__(self, doc: Document) -> str | None:
        url = doc.metadata.get("url")
        if not url:
            return "missing_url: no metadata url" if self.cfg.missing_url == "reject" else None
        host = (urlsplit(url).hostname or "").lower()
        parts = host.split(".")
        for i in range(len(parts) - 1):
            if ".".join(parts[i:]) in self.domains:
                return f"domain: {host} is blocked"
        words = set(_URL_SPLIT.split(url.lower()))
        banned = sorted(words & self.banned)
        if banned:
            return f"hard_blacklisted: {banned[0]!r} in URL"
        soft = words & self.soft
        if len(soft) >= self.cfg.soft_word_threshold:
            return f"soft_blacklisted: {len(soft)} soft-banned words >= {self.cfg.soft_word_threshold}"
        squashed = _URL_SPLIT.sub("", url).lower()
        for sub in self.subwords:
            if sub and sub in squashed:
                return f"blacklisted_subword: {sub!r} in URL"
        return None


# --------------------------------------------------------------------------- Gopher quality

GOPHER_STOP_WORDS = ["the", "be", "to", "of", "and", "that", "have", "with"]


@dataclass
class GopherQualityConfig:
    """Gopher's quality rules (Rae et al. 2021, arXiv:2112.11446, A.1.1); datatrove's defaults, and
    null turns a rule off. Words are the tokens that are not symbols."""

    min_doc_words: int | None = at_least(0, 50, help="reject a document with fewer words")
    max_doc_words: int | None = at_least(0, 100_000, help="reject a document with more words")
    min_avg_word_length: float | None = at_least(
        0, 3, help="reject a document whose words' mean length in characters is below this"
    )
    max_avg_word_length: float | None = at_least(
        0, 10, help="reject a document whose words' mean length in characters is above this"
    )
    max_symbol_word_ratio: float | None = at_least(
        0, 0.1, help="reject a document with more '#' per token, or more '...' and '…' per token, than this"
    )
    max_bullet_lines_ratio: float | None = unit_interval(
        0.9, help="reject a document whose share of lines starting with '•' or '-' is above this"
    )
    max_ellipsis_lines_ratio: float | None = unit_interval(
        0.3, help="reject a document whose share of lines ending with '...' or '…' is above this"
    )
    min_alpha_words_ratio: float | None = unit_interval(
        0.8, help="reject a document whose share of tokens with a letter is below this (datatrove's "
        "max_non_alpha_words_ratio, the same rule)",
    )
    min_stop_words: int | None = at_least(
        0, 2, help="reject a document with fewer tokens that are stop words (case-sensitive, as in datatrove)"
    )
    stop_words: list[str] = option(
        default_factory=lambda: list(GOPHER_STOP_WORDS), help="the words min_stop_words counts (Gopher's)"
    )


class GopherQualityFilter:
    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig):
        self.cfg = cfg
        self.stop_words = set(cfg.stop_words)

    def __call__(self, doc: Document) -> str | None:
        c, text = self.cfg, doc.text
        tokens = split_words(text)
        words = [t for t in tokens if not is_symbol(t)]
        n = len(words)
        if reason := _under("gopher_short_doc", n, c.min_doc_words) or _over("gopher_long_doc", n, c.max_doc_words):
            return reason
        if not tokens or not words:
            return "gopher_short_doc: no words"
        mean = sum(map(len, words)) / n
        if reason := (_under("gopher_below_avg_threshold", mean, c.min_avg_word_length)
                      or _over("gopher_above_avg_threshold", mean, c.max_avg_word_length)
                      or _over("gopher_too_many_hashes", text.count("#") / len(tokens), c.max_symbol_word_ratio)
                      or _over("gopher_too_many_ellipsis", (text.count("...") + text.count("…")) / len(tokens),
                               c.max_symbol_word_ratio)):
            return reason
        lines = text.splitlines() or [""]
        bullets = sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines)
        ellipsis = sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
        alpha = sum(any(ch.isalpha() for ch in t) for t in tokens) / len(tokens)
        stops = sum(t in self.stop_words for t in tokens)
        return (_over("gopher_too_many_bullets", bullets, c.max_bullet_lines_ratio)
                or _over("gopher_too_many_end_ellipsis", ellipsis, c.max_ellipsis_lines_ratio)
                or _under("gopher_below_alpha_threshold", alpha, c.min_alpha_words_ratio)
                or _under("gopher_enough_stop_words", stops, c.min_stop_words))


# --------------------------------------------------------------------------- Gopher repetition


@dataclass
class GopherRepetitionConfig:
    """Gopher's repetition rules (arXiv:2112.11446, Table A1); fractions of characters unless named."""

    dup_line_frac: float | None = unit_interval(
        0.3, help="reject a document whose share of lines repeating an earlier line is above this"
    )
    dup_para_frac: float | None = unit_interval(
        0.3, help="reject a document whose share of paragraphs (split on blank lines) repeating an earlier one is "
        "above this",
    )
    dup_line_char_frac: float | None = unit_interval(
        0.2, help="reject a document whose share of characters in repeated lines is above this"
    )
    dup_para_char_frac: float | None = unit_interval(
        0.2, help="reject a document whose share of characters in repeated paragraphs is above this"
    )
    top_n_grams: dict[int, float] = unit_interval(
        keys=Range(1), default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16},
        help="n -> the largest share of characters the most frequent word n-gram may cover",
    )
    dup_n_grams: dict[int, float] = unit_interval(
        keys=Range(1), default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        help="n -> the largest share of characters in word n-grams that repeat an earlier one",
    )


def find_duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items seen before, their total characters); datatrove's ``find_duplicates``."""
    seen: set[str] = set()
    n = chars = 0
    for item in items:
        if item in seen:
            n += 1
            chars += len(item)
        else:
            seen.add(item)
    return n, chars


def top_ngram_chars(words: list[str], n: int) -> int:
    """Characters covered by the most frequent word n-gram: len(n-gram) * count."""
    grams = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0
    gram, count = grams.most_common(1)[0]
    return len(gram) * count


def duplicated_ngram_chars(words: list[str], n: int) -> int:
    """Characters of n-grams seen before, skipping past each repeat (datatrove's ``find_all_duplicate``)."""
    seen: set[str] = set()
    chars = i = 0
    while i < len(words) - n + 1:
        gram = "".join(words[i : i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


_PARAGRAPH_SPLIT = re.compile(r"\n{2,}")
_LINE_SPLIT = re.compile(r"\n+")


class GopherRepetitionFilter:
    name = "gopher_repetition"

    def __init__(self, cfg: GopherRepetitionConfig):
        self.cfg = cfg

    def __call__(self, doc: Document) -> str | None:
        c, text = self.cfg, doc.text
        if not text:
            return "empty: no text"
        paragraphs = _PARAGRAPH_SPLIT.split(text.strip())
        dup, chars = find_duplicates(paragraphs)
        if reason := (_over("dup_para_frac", dup / len(paragraphs), c.dup_para_frac)
                      or _over("dup_para_char_frac", chars / len(text), c.dup_para_char_frac)):
            return reason
        lines = _LINE_SPLIT.split(text)
        dup, chars = find_duplicates(lines)
        if reason := (_over("dup_line_frac", dup / len(lines), c.dup_line_frac)
                      or _over("dup_line_char_frac", chars / len(text), c.dup_line_char_frac)):
            return reason
        words = split_words(text)
        for n, limit in sorted(c.top_n_grams.items()):
            if reason := _over(f"top_{n}_gram", top_ngram_chars(words, n) / len(text), limit):
                return reason
        for n, limit in sorted(c.dup_n_grams.items()):
            if reason := _over(f"duplicated_{n}_n_grams", duplicated_ngram_chars(words, n) / len(text), limit):
                return reason
        return None


# --------------------------------------------------------------------------- C4


C4_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY_SUBSTRINGS = ["terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
                        "use cookies"]
# Sentences for the C4 count: text up to '.', '!' or '?' followed by a space or the end
# (datatrove uses spaCy's sentencizer, which splits the same way on ordinary prose).
SENTENCE_END = re.compile(r"[.!?]+(?:['\"”’)\]]*)(?=\s|$)")


def count_sentences(line: str) -> int:
    """Sentences in a line: terminal punctuation marks followed by space or the end, at least 1."""
    return max(1, len(SENTENCE_END.findall(line)))


@dataclass
class C4QualityConfig:
    """C4's line and document rules (Raffel et al. 2020, §2.2; TFDS c4_utils), datatrove's defaults.

    Lines are dropped for a too-long word, no terminal punctuation, too few words,
    "javascript" or a cookie/terms-of-use phrase; the document is dropped for "lorem ipsum",
    a curly bracket, or fewer than ``min_num_sentences`` sentences in the kept lines. The
    kept lines replace the text. The bad-words rule is left out: its list is a download.
    """

    remove_citations: bool = option(True, help="strip the citation marks [1], [edit] and [citation needed] from lines")
    filter_no_terminal_punct: bool = option(
        True, help="drop the lines that do not end in . ? ! \" or ' (or that end in ...); FineWeb ran with false"
    )
    min_num_sentences: int | None = at_least(
        0, 5, help="reject a document with fewer sentences in its kept lines (null: no minimum)"
    )
    min_words_per_line: int | None = at_least(0, 3, help="drop the lines with fewer words (null: keep them)")
    max_word_length: int | None = positive(
        1000, help="drop the lines with a word longer than this many characters (null: keep them)"
    )
    filter_lorem_ipsum: bool = option(True, help="reject a document containing 'lorem ipsum'")
    filter_javascript: bool = option(True, help="drop the lines containing 'javascript'")
    filter_curly_bracket: bool = option(True, help="reject a document containing a curly bracket '{'")
    filter_policy: bool = option(
        True, help="drop the lines with a cookie or terms-of-use phrase ('terms of use', 'privacy policy', "
        "'uses cookies', ...)",
    )


class C4QualityFilter:
    name = "c4_quality"

    def __init__(self, cfg: C4QualityConfig):
        self.cfg = cfg

    def __call__(self, doc: Document) -> str | None:
        c = self.cfg
        kept: list[str] = []
        sentences = 0
        for raw in doc.text.splitlines():
            line = raw.strip()
            words = line.split()
            if c.max_word_length is not None and any(len(w) > c.max_word_length for w in words):
                continue
            if c.remove_citations:
                line = C4_CITATION.sub("", line)
            if c.filter_no_terminal_punct and (not line.endswith(C4_END_PUNCTUATION) or line.endswith("...")):
                continue
            if c.min_words_per_line is not None and len(words) < c.min_words_per_line:
                continue
            lower = line.lower()
            if c.filter_lorem_ipsum and "lorem ipsum" in lower:
                return "lorem_ipsum: the text contains 'lorem ipsum'"
            if c.filter_javascript and "javascript" in lower:
                continue
            if c.filter_curly_bracket and "{" in line:
                return "curly_bracket: the text contains '{'"
            if c.filter_policy and any(p in lower for p in C4_POLICY_SUBSTRINGS):
                continue
            sentences += count_sentences(line)
            kept.append(line)
        if reason := _under("too_few_sentences", sentences, c.min_num_sentences):
            return reason
        doc.text = "\n".join(kept).strip()
        return None


# --------------------------------------------------------------------------- FineWeb


@dataclass
class FineWebQualityConfig:
    """FineWeb's own rules (Penedo et al. 2024, arXiv:2406.17557), datatrove's code defaults.

    The blog gives 0.1 for the duplicated-line characters; the code that ran uses 0.01.
    """

    line_punct_thr: float | None = unit_interval(
        0.12, help="reject a document whose share of lines ending in . ' \" ! ? is at most this"
    )
    line_punct_exclude_zero: bool = option(
        False, help="keep the documents where no line ends in punctuation, which line_punct_thr would reject"
    )
    short_line_thr: float | None = unit_interval(
        0.67, help="reject a document whose share of short lines (short_line_length characters or fewer) is at least this"
    )
    short_line_length: int = at_least(0, 30, help="the most characters of a short line, for short_line_thr")
    char_duplicates_ratio: float | None = unit_interval(
        0.01, help="reject a document whose share of characters in repeated lines is at least this (the code's 0.01; "
        "the blog gives 0.1)",
    )
    new_line_ratio: float | None = at_least(
        0, 0.3, help="reject a document with more newlines per word than this (the rule datatrove calls list_ratio)"
    )


class FineWebQualityFilter:
    name = "fineweb_quality"

    def __init__(self, cfg: FineWebQualityConfig):
        self.cfg = cfg

    def __call__(self, doc: Document) -> str | None:
        c, text = self.cfg, doc.text
        lines = text.split("\n")
        ratio = sum(line.endswith((".", "'", '"', "!", "?")) for line in lines) / len(lines)
        if c.line_punct_thr is not None and ratio <= c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero):
            return f"line_punct_ratio: {ratio:.3g} <= {c.line_punct_thr:g}"
        ratio = sum(len(line) <= c.short_line_length for line in lines) / len(lines)
        if c.short_line_thr is not None and ratio >= c.short_line_thr:
            return f"short_line_ratio: {ratio:.3g} >= {c.short_line_thr:g}"
        chars = len(text.replace("\n", ""))
        ratio = find_duplicates([line for line in lines if line.strip()])[1] / max(chars, 1)
        if c.char_duplicates_ratio is not None and ratio >= c.char_duplicates_ratio:
            return f"char_dup_ratio: {ratio:.3g} >= {c.char_duplicates_ratio:g}"
        words = split_words(text)
        ratio = text.count("\n") / max(len(words), 1)
        return _over("list_ratio", ratio, c.new_line_ratio)
