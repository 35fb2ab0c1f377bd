"""HTML to main text, with a per-document time limit.

Two extractors: ``resiliparse`` (default; ``extract_plain_text(HTMLTree.parse(html),
main_content=True)``, ~1,400 pages/s) and ``trafilatura`` (``favor_precision=True``,
``include_comments=False``, ``deduplicate=True``, as datatrove's FineWeb extractor; cleaner
but ~20x slower). An HTML page that extracts to nothing or takes longer than ``timeout_s``
is rejected with that reason.

Which documents are HTML is read from ``metadata["content_type"]``, which the readers set
for WARC records and ``.html`` files:

* HTML or XHTML, or a WARC record that names no type (``""``, as datatrove extracts
  those): extracted.
* no ``content_type`` at all (JSONL, Parquet and plain-text inputs, unless a record has
  that field) or ``text/plain`` (WET conversion records, plain-text payloads): already
  text, passed through unchanged. Running an HTML parser on them would drop whatever
  follows a ``<`` and join the lines the line-based Gopher/C4/FineWeb rules count.
* any other type (PDF, images, scripts): rejected as ``not-html`` (``html_only: false``
  extracts them as HTML instead).

The time limit is an interval timer (``SIGALRM``) around each extraction, as datatrove
limits its extractor; it needs the worker's main thread (process-pool and Ray workers run
tasks there) and interrupts the extractor when control returns to Python.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from lmforge.core.run import log
from lmforge.curate.base import Document
from lmforge.curate.readers import HTML_TYPES

TEXT_TYPES = ("text/plain",)  # content types passed through as they are


@dataclass
class ExtractConfig:
    extractor: Literal["resiliparse", "trafilatura"] = "resiliparse"
    timeout_s: float = 5.0  # per document; 0 disables (datatrove: 1 s for trafilatura in a subprocess)
    main_content: bool = True  # resiliparse: drop navigation, headers and footers
    html_only: bool = True  # reject documents of a content type neither HTML nor text/plain (false: extract them)
    min_chars: int = 1  # shorter extracted text is rejected as empty

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")


class ExtractionTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise ExtractionTimeout


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``ExtractionTimeout`` in the block after ``seconds`` (main thread only; else no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def resiliparse_text(html: str, main_content: bool = True) -> str:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    return extract_plain_text(HTMLTree.parse(html), main_content=main_content)


def trafilatura_text(html: str, main_content: bool = True) -> str:
    import trafilatura

    return trafilatura.extract(html, favor_precision=True, include_comments=False, deduplicate=True) or ""


EXTRACTORS: dict[str, Callable[[str, bool], str]] = {"resiliparse": resiliparse_text, "trafilatura": trafilatura_text}


class HtmlExtract:
    """DocumentStep: replace an HTML document's text by its main text; other text passes unchanged."""

    name = "extract"

    def __init__(self, cfg: ExtractConfig, extractor: Callable[[str, bool], str] | None = None):
        self.cfg = cfg
        self.extractor = extractor or EXTRACTORS[cfg.extractor]
        if cfg.timeout_s and threading.current_thread() is not threading.main_thread():
            log.warning("extract: not on the main thread, so the %.1f s time limit cannot be enforced", cfg.timeout_s)

    def __call__(self, doc: Document) -> str | None:
        ctype = doc.metadata.get("content_type")
        if not isinstance(ctype, str) or ctype.lower() in TEXT_TYPES:
            return None  # already text: JSONL, Parquet, plain-text files and payloads
        if ctype and ctype.lower() not in HTML_TYPES and self.cfg.html_only:
            return f"not-html: content type {ctype}"
        if not doc.text.strip():
            return "empty-page: no HTML"
        try:
            with time_limit(self.cfg.timeout_s):
                text = self.extractor(doc.text, self.cfg.main_content)
        except ExtractionTimeout:
            return f"extraction-timeout: over {self.cfg.timeout_s:g} s"
        text = (text or "").strip()
        if len(text) < self.cfg.min_chars:
            return "empty-text: nothing left after extraction"
        doc.text = text
        return None
