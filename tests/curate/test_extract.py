import time

from lmforge.curate.base import Document
from lmforge.curate.extract import ExtractConfig, HtmlExtract
from lmforge.curate.langid import LanguageConfig, LanguageFilter
from tests.curate.warc_fixtures import PROSE, page


def test_resiliparse_keeps_the_main_text_and_drops_navigation():
    doc = Document("d", page(PROSE["en"], "News"), {"content_type": "text/html"})
    assert HtmlExtract(ExtractConfig())(doc) is None
    assert "The library opened" in doc.text and "Home | About" not in doc.text and "<p>" not in doc.text


def test_trafilatura_extracts_with_precision():
    doc = Document("d", page(PROSE["en"] * 2, "News"), {"content_type": "text/html"})
    assert HtmlExtract(ExtractConfig(extractor="trafilatura"))(doc) is None
    assert "The library opened" in doc.text and "Home | About" not in doc.text


def test_non_html_and_empty_pages_are_rejected():
    step = HtmlExtract(ExtractConfig())
    assert step(Document("d", "%PDF-1.4", {"content_type": "application/pdf"})).startswith("not-html")
    assert step(Document("d", "  ", {"content_type": "text/html"})).startswith("empty-page")
    script_only = "<html><body><script>x()</script></body></html>"
    assert step(Document("d", script_only, {"content_type": "text/html"})).startswith("empty-text")
    assert step(Document("d", script_only, {"content_type": ""})).startswith("empty-text")  # WARC, no type: HTML
    pdf = Document("d", "<p>%PDF-1.4</p>", {"content_type": "application/pdf"})
    assert HtmlExtract(ExtractConfig(html_only=False))(pdf) is None and pdf.text == "%PDF-1.4"


def test_documents_that_are_not_html_pass_through_unchanged():
    text = "Use #include <stdio.h> in C programs\nand compare if a<b\n\n  indented line <br> kept\n"
    step = HtmlExtract(ExtractConfig())
    for meta in ({}, {"source": "a.jsonl"}, {"content_type": "text/plain"}, {"content_type": "TEXT/PLAIN"}):
        doc = Document("d", text, dict(meta))
        assert step(doc) is None and doc.text == text and doc.metadata == meta
    html = Document("d", f"<html><body><p>{text}</p></body></html>", {"content_type": "text/html"})
    assert step(html) is None and html.text == "Use #include in C programs and compare if a kept"  # parsed as tags


def test_an_extractor_that_hangs_is_cut_off_and_rejected():
    def hang(html, main_content):
        time.sleep(30)
        return "never"

    step = HtmlExtract(ExtractConfig(timeout_s=0.2), extractor=hang)
    t0 = time.perf_counter()
    reason = step(Document("d", "<p>x</p>", {"content_type": "text/html"}))
    assert reason.startswith("extraction-timeout") and time.perf_counter() - t0 < 2


def test_language_is_annotated_and_filtered_by_set_and_threshold():
    step = LanguageFilter(LanguageConfig(languages=["en"], threshold=0.65))
    en, fr = Document("e", PROSE["en"]), Document("f", PROSE["fr"])
    assert step(en) is None and en.metadata["language"] == "en" and en.metadata["language_score"] > 0.9
    assert step(fr).startswith("language: fr") and fr.metadata["language"] == "fr"
    assert LanguageFilter(LanguageConfig(languages=[]))(Document("f", PROSE["fr"])) is None  # any language
    strict = LanguageFilter(LanguageConfig(languages=["en"], threshold=0.999999))
    assert strict(Document("m", "ok ok computer")).startswith(("language_score", "language:"))
