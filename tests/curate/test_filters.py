"""Each heuristic filter on crafted documents on both sides of its threshold (datatrove's defaults)."""

import dataclasses

import pytest

from lmforge.curate.filters import (
    C4QualityConfig,
    C4QualityFilter,
    FineWebQualityConfig,
    FineWebQualityFilter,
    GopherQualityConfig,
    GopherQualityFilter,
    GopherRepetitionConfig,
    GopherRepetitionFilter,
    UrlFilter,
    UrlFilterConfig,
    split_words,
)
from lmforge.data.documents import Document

WORDS = "the quick brown fox jumps over the lazy dog and runs with that small cat".split()


def words(n: int, vocab: list[str] = WORDS) -> str:
    return " ".join(vocab[i % len(vocab)] for i in range(n))


def only(cls, **kept):
    """The config with every optional threshold off except those named (at their defaults unless given)."""
    off = {}
    for f in dataclasses.fields(cls):
        if f.name in kept:
            continue
        if "None" in str(f.type):
            off[f.name] = None
        elif "dict" in str(f.type):
            off[f.name] = {}
        elif f.type == "bool" and f.name.startswith("filter_"):
            off[f.name] = False
    return cls(**off, **{k: v for k, v in kept.items() if v is not ...})


def verdict(step, text: str, **meta):
    doc = Document("d", text, dict(meta))
    return step(doc), doc


def rule(reason):
    return None if reason is None else reason.split(":")[0]


def test_split_words_keeps_inner_punctuation_and_groups_symbols():
    assert split_words("Don't stop... e.g. well-known 3.14 #tag") == \
        ["Don't", "stop", "...", "e.g", ".", "well-known", "3.14", "#", "tag"]


def test_defaults_are_datatrove_values():
    g = GopherQualityConfig()
    assert (g.min_doc_words, g.max_doc_words, g.min_avg_word_length, g.max_avg_word_length) == (50, 100_000, 3, 10)
    assert (g.max_symbol_word_ratio, g.max_bullet_lines_ratio, g.max_ellipsis_lines_ratio) == (0.1, 0.9, 0.3)
    assert (g.min_alpha_words_ratio, g.min_stop_words) == (0.8, 2)
    r = GopherRepetitionConfig()
    assert (r.dup_line_frac, r.dup_para_frac, r.dup_line_char_frac, r.dup_para_char_frac) == (0.3, 0.3, 0.2, 0.2)
    assert r.top_n_grams == {2: 0.2, 3: 0.18, 4: 0.16}
    assert r.dup_n_grams == {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    f = FineWebQualityConfig()
    assert (f.line_punct_thr, f.short_line_thr, f.short_line_length, f.char_duplicates_ratio, f.new_line_ratio) == \
        (0.12, 0.67, 30, 0.01, 0.3)
    c = C4QualityConfig()
    assert (c.min_num_sentences, c.min_words_per_line, c.max_word_length) == (5, 3, 1000)


# --------------------------------------------------------------------------- Gopher quality

@pytest.mark.parametrize("name, good, bad, cfg", [
    ("gopher_short_doc", words(50), words(49), only(GopherQualityConfig, min_doc_words=...)),
    ("gopher_long_doc", words(100_000), words(100_001), only(GopherQualityConfig, max_doc_words=...)),
    # mean word length: 3.0 passes, below 3 fails; 10.0 passes, above fails
    ("gopher_below_avg_threshold", words(50, ["the", "and"]), words(49, ["the", "and"]) + " to",
     only(GopherQualityConfig, min_avg_word_length=...)),
    ("gopher_above_avg_threshold", words(50, ["abcdefghij"]), words(49, ["abcdefghij"]) + " abcdefghijk",
     only(GopherQualityConfig, max_avg_word_length=...)),
    # '#' per token: 5 of 55 passes, 6 of 56 fails
    ("gopher_too_many_hashes", words(50) + " #" * 5, words(50) + " #" * 6, only(GopherQualityConfig, max_symbol_word_ratio=...)),
    ("gopher_too_many_ellipsis", words(50) + " ..." * 5 + " end", words(50) + " …" * 6 + " end",
     only(GopherQualityConfig, max_symbol_word_ratio=...)),
    # 9 of 10 lines bulleted passes (not > 0.9), 10 of 10 fails
    ("gopher_too_many_bullets", "intro " + words(5) + "\n" + "\n".join("- " + words(5) for _ in range(9)),
     "\n".join("• " + words(5) for _ in range(10)), only(GopherQualityConfig, max_bullet_lines_ratio=...)),
    ("gopher_too_many_end_ellipsis", "\n".join(words(6) + ("..." if i < 3 else ".") for i in range(10)),
     "\n".join(words(6) + ("…" if i < 4 else ".") for i in range(10)), only(GopherQualityConfig, max_ellipsis_lines_ratio=...)),
    # tokens with a letter: 48 of 60 (0.8) passes, 48 of 61 fails
    ("gopher_below_alpha_threshold", words(48) + " 123" * 12, words(48) + " 123" * 13,
     only(GopherQualityConfig, min_alpha_words_ratio=...)),
    ("gopher_enough_stop_words", "the " + words(60, ["cat", "dog"]) + " and", "the " + words(60, ["cat", "dog"]),
     only(GopherQualityConfig, min_stop_words=...)),
])
def test_gopher_quality_rule_on_both_sides_of_its_threshold(name, good, bad, cfg):
    step = GopherQualityFilter(cfg)
    assert verdict(step, good)[0] is None
    assert rule(verdict(step, bad)[0]) == name


def test_gopher_quality_defaults_keep_ordinary_prose():
    text = ("The committee met on Tuesday to discuss the budget and the plans for the new library. "
            "Members agreed that the building should open next spring, with longer hours and more books. ") * 3
    assert GopherQualityFilter(GopherQualityConfig())(Document("d", text)) is None


# --------------------------------------------------------------------------- Gopher repetition

FIVE = " ".join(c * 10 for c in "abcde")
PARAS = [f"paragraph {i} " + words(8 + i) for i in range(10)]


@pytest.mark.parametrize("name, good, bad, cfg", [
    # 3 of 10 paragraphs repeated passes (not > 0.3), 4 of 10 fails
    ("dup_para_frac", "\n\n".join(PARAS[:7] + PARAS[:3]), "\n\n".join(PARAS[:6] + PARAS[:4]),
     only(GopherRepetitionConfig, dup_para_frac=...)),
    ("dup_line_frac", "\n".join(PARAS[:7] + PARAS[:3]), "\n".join(PARAS[:6] + PARAS[:4]),
     only(GopherRepetitionConfig, dup_line_frac=...)),
    # one repeated paragraph of 19 chars in 100 passes (<= 0.2); of 21 chars fails
    ("dup_para_char_frac", "a" * 19 + "\n\n" + "a" * 19 + "\n\n" + "b" * 58, "a" * 21 + "\n\n" + "a" * 21 + "\n\n" + "b" * 54,
     only(GopherRepetitionConfig, dup_para_char_frac=...)),
    ("dup_line_char_frac", "a" * 20 + "\n" + "a" * 20 + "\n" + "b" * 58, "a" * 21 + "\n" + "a" * 21 + "\n" + "b" * 56,
     only(GopherRepetitionConfig, dup_line_char_frac=...)),
    # top 2-gram "aa bb" (5 chars) x4 = 20 of 100 chars passes, x5 = 25 of 100 fails
    ("top_2_gram", " ".join(["aa bb"] * 4) + " " + "c" * 76, " ".join(["aa bb"] * 5) + " " + "c" * 70,
     only(GopherRepetitionConfig, top_n_grams={2: 0.2})),
    # five 10-letter words repeated once: 50 duplicated chars; a text of 334 chars passes (0.1497), 333 fails
    ("duplicated_5_n_grams", FIVE + " " + FIVE + " " + "z" * 224, FIVE + " " + FIVE + " " + "z" * 223,
     only(GopherRepetitionConfig, dup_n_grams={5: 0.15})),
])
def test_gopher_repetition_rule_on_both_sides_of_its_threshold(name, good, bad, cfg):
    step = GopherRepetitionFilter(cfg)
    assert verdict(step, good)[0] is None, verdict(step, good)[0]
    assert rule(verdict(step, bad)[0]) == name


def test_gopher_repetition_defaults_reject_a_page_of_one_repeated_line():
    assert GopherRepetitionFilter(GopherRepetitionConfig())(Document("d", "buy now and save\n" * 20)) is not None


# --------------------------------------------------------------------------- C4

SENT = "This line is a full sentence."


def test_c4_document_needs_five_sentences_in_kept_lines():
    step = C4QualityFilter(C4QualityConfig())
    assert rule(verdict(step, "\n".join([SENT] * 4))[0]) == "too_few_sentences"
    reason, doc = verdict(step, "\n".join([SENT] * 4 + ["Two sentences here. And another one!"]))
    assert reason is None and doc.text.count("\n") == 4


def test_c4_drops_lines_without_terminal_punctuation_few_words_or_long_words():
    step = C4QualityFilter(C4QualityConfig())
    text = "\n".join([SENT] * 5 + ["no terminal punctuation here", "ends with ellipsis...", "Two words.",
                                  "Three words ok.", "x" * 1001 + " is long.", "x" * 1000 + " is fine."])
    reason, doc = verdict(step, text)
    assert reason is None
    assert doc.text.split("\n")[5:] == ["Three words ok.", "x" * 1000 + " is fine."]


def test_c4_drops_javascript_and_policy_lines_and_citations():
    step = C4QualityFilter(C4QualityConfig())
    text = "\n".join([SENT] * 5 + ["Please enable JavaScript to view.", "Read our privacy policy now.",
                                  "A claim with a source[1] here[edit]."])
    reason, doc = verdict(step, text)
    assert reason is None and doc.text.split("\n")[5:] == ["A claim with a source here."]


@pytest.mark.parametrize("bad, name", [("Lorem ipsum dolor sit amet.", "lorem_ipsum"),
                                       ("A function body { return x; }.", "curly_bracket")])
def test_c4_rejects_whole_document_for_lorem_ipsum_or_curly_bracket(bad, name):
    assert rule(C4QualityFilter(C4QualityConfig())(Document("d", "\n".join([SENT] * 5 + [bad])))) == name
    assert C4QualityFilter(C4QualityConfig(filter_lorem_ipsum=False, filter_curly_bracket=False))(
        Document("d", "\n".join([SENT] * 5 + [bad]))) is None


# --------------------------------------------------------------------------- FineWeb

LONG = "this line is long enough to not count as short"


@pytest.mark.parametrize("name, good, bad, cfg", [
    # lines ending in punctuation: 4 of 25 passes, 3 of 25 (0.12, <=) fails
    ("line_punct_ratio", "\n".join([LONG + "."] * 4 + [LONG] * 21), "\n".join([LONG + "."] * 3 + [LONG] * 22),
     only(FineWebQualityConfig, line_punct_thr=...)),
    # lines of <= 30 chars: 66 of 100 passes, 67 of 100 fails
    ("short_line_ratio", "\n".join(["short."] * 66 + [LONG] * 34), "\n".join(["short."] * 67 + [LONG] * 33),
     only(FineWebQualityConfig, short_line_thr=...)),
    # chars in repeated lines / chars: 9 of 1000 passes, 10 of 1000 fails
    ("char_dup_ratio", "\n".join(["abc"] * 4 + ["x" * 988]), "\n".join(["abcde"] * 3 + ["x" * 985]),
     only(FineWebQualityConfig, char_duplicates_ratio=...)),
    # newlines / words: 9 / 30 passes, 10 / 30 fails
    ("list_ratio", "\n".join(["one two three"] * 10), "\n".join(["one two three"] * 10) + "\n",
     only(FineWebQualityConfig, new_line_ratio=...)),
])
def test_fineweb_rule_on_both_sides_of_its_threshold(name, good, bad, cfg):
    step = FineWebQualityFilter(cfg)
    assert verdict(step, good)[0] is None, verdict(step, good)[0]
    assert rule(verdict(step, bad)[0]) == name


# --------------------------------------------------------------------------- URL


def test_url_filter_blocks_domains_with_subdomains_and_banned_words(tmp_path):
    (tmp_path / "domains.txt").write_text("# blocked\nbad.example\n")
    step = UrlFilter(UrlFilterConfig(domains_file=str(tmp_path / "domains.txt"), banned_words=["casino"],
                                     soft_banned_words=["free", "win"], banned_subwords=["xyz"]))
    assert rule(verdict(step, "t", url="https://www.bad.example/page")[0]) == "domain"
    assert verdict(step, "t", url="https://notbad.example/page")[0] is None
    assert rule(verdict(step, "t", url="https://ok.org/online-casino/")[0]) == "hard_blacklisted"
    assert verdict(step, "t", url="https://ok.org/casinos/")[0] is None  # a whole word only
    assert verdict(step, "t", url="https://ok.org/free/")[0] is None  # one soft word < 2
    assert rule(verdict(step, "t", url="https://ok.org/free/win")[0]) == "soft_blacklisted"
    assert rule(verdict(step, "t", url="https://ok.org/x-y-z")[0]) == "blacklisted_subword"
    assert verdict(step, "t")[0] is None
    assert rule(UrlFilter(UrlFilterConfig(missing_url="reject"))(Document("d", "t"))) == "missing_url"
