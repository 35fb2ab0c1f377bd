"""HTML to main text, in a child process that a per-document time limit can kill.

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

The time limit: a page that hangs does so inside C code (resiliparse's parser, lxml inside
trafilatura), where a SIGALRM handler runs only once the C call returns, so the extractor
runs in a child process that can be killed, as datatrove's ``ExtractorSandbox`` does. Each curate worker forks one child
on its first HTML page and sends it every page over a pipe, waiting at most ``timeout_s``
for the text. A page that overruns is rejected as ``extraction-timeout`` and the child
killed; a page that kills the child (a segfault, the OOM killer, which is told to pick it
first) is rejected as ``extraction-crash``; either way the next page gets a fresh child.
Each page costs two process wake-ups and a copy: ~0.25 ms on a 2-vCPU VM, where that makes
resiliparse extraction ~30% slower (trafilatura a few percent; the demo recipe end to end
within run-to-run noise). ``timeout_s: 0`` extracts in the worker itself, with no limit.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Literal

from lmforge.core.config import at_least, check_ranges, option
from lmforge.curate.readers import HTML_TYPES
from lmforge.data.documents import Document

TEXT_TYPES = ("text/plain",)  # content types passed through as they are
STARTUP_TIMEOUT_S = 60.0  # for a fresh child's fork and warm-up (imports), which timeout_s does not count
WARM_UP_PAGE = "<html><body><p>Warm up.</p></body></html>"


@dataclass
class ExtractConfig:
    """HTML to main text, by content type: HTML pages are extracted, text (no content_type, or
    text/plain) passes through unchanged, other types are rejected as not-html (html_only)."""

    extractor: Literal["resiliparse", "trafilatura"] = option(
        "resiliparse",
        help="resiliparse: extract_plain_text(main_content=True), fast; trafilatura: favor_precision=True, "
        "as datatrove's FineWeb extractor, cleaner but about 20x slower",
    )
    timeout_s: float = at_least(
        0, 5.0,
        help="seconds per page, in a child process that is killed when a page overruns (the page is rejected as "
        "extraction-timeout); 0 extracts in the worker itself, with no limit (datatrove: 1 s for trafilatura)",
    )
    main_content: bool = option(True, help="resiliparse: drop navigation, headers and footers")
    html_only: bool = option(
        True, help="reject documents whose content type is neither HTML nor text/plain (false: extract them as HTML)"
    )
    min_chars: int = at_least(0, 1, help="extracted text shorter than this many characters is rejected as empty")

    def __post_init__(self) -> None:
        check_ranges(self, "extract.")  # built in Python too


class ExtractionTimeout(Exception):
    pass


class ExtractionCrash(Exception):
    pass


def resiliparse_text(html: str, main_content: bool = True) -> str:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    return extract_plain_text(HTMLTree.parse(html), main_content=main_content)


def trafilatura_text(html: str, main_content: bool = True) -> str:
    import trafilatura

    return trafilatura.extract(html, favor_precision=True, include_comments=False, deduplicate=True) or ""


EXTRACTORS: dict[str, Callable[[str, bool], str]] = {"resiliparse": resiliparse_text, "trafilatura": trafilatura_text}


def _detach_from_parent(parent_pid: int) -> None:
    """In the child: leave Ctrl-C to the worker, let SIGTERM kill even inside C code, die with the
    worker (Linux ``PR_SET_PDEATHSIG``) and be the OOM killer's first pick. Best effort off Linux."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000\n")
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent_pid:  # the worker exited before prctl took effect
        os._exit(0)


def _serve(conn: Connection, parent_end: Connection, extractor: Callable[[str, bool], str], main_content: bool,
           parent_pid: int) -> None:
    """The child: answer each HTML string with ``(True, text)`` or ``(False, exception)`` until the pipe closes."""
    parent_end.close()  # the fork's copy; the worker's end closing must reach us as EOF
    _detach_from_parent(parent_pid)
    try:
        extractor(WARM_UP_PAGE, main_content)  # imports, so that they don't count against the first page's limit
    except Exception:  # noqa: BLE001 -- a real page will raise it again, where it is reported
        pass
    conn.send(None)
    while True:
        try:
            html = conn.recv()
        except EOFError:
            return
        try:
            answer = (True, extractor(html, main_content))
        except Exception as exc:  # noqa: BLE001 -- raised again in the worker, which rejects the page
            answer = (False, (type(exc).__name__, str(exc)))  # names travel; not every exception unpickles
        conn.send(answer)


class ExtractorSandbox:
    """``extractor`` in a long-lived child process, forked on first use, reused for every page, and
    killed and reaped (no zombie) when a page overruns ``timeout_s``, on ``close`` or with this object."""

    def __init__(self, extractor: Callable[[str, bool], str], main_content: bool, timeout_s: float):
        self.extractor = extractor
        self.main_content = main_content
        self.timeout_s = timeout_s
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.owner = 0  # the process that started ``process``
        self.starts = 0

    def extract(self, html: str) -> str:
        """The extractor's text; raises ``ExtractionTimeout``, ``ExtractionCrash`` or what the extractor raised."""
        self._drop_if_inherited()
        if self.process is None:
            self._start()
        try:
            self.conn.send(html)
        except OSError:  # the idle child is gone (killed from outside): one retry with a fresh one
            self.close()
            self._start()
            self.conn.send(html)
        if not self.conn.poll(self.timeout_s):
            self.close()
            raise ExtractionTimeout
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise ExtractionCrash(f"the extraction process died ({self._reap()})") from None
        if not ok:
            name, message = value
            raise type(name, (Exception,), {})(message)  # the extractor's error, by its name and message
        return value

    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")  # no pickling; the child inherits the imported extractor
        parent_end, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_serve, name="lmforge-extract", daemon=True,
                                   args=(child_end, parent_end, self.extractor, self.main_content, os.getpid()))
        self.process.start()
        child_end.close()  # so that the child's death reaches this end as EOF
        self.conn = parent_end
        self.owner = os.getpid()
        self.starts += 1
        if not parent_end.poll(STARTUP_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"extract: the extraction process did not start within {STARTUP_TIMEOUT_S:g} s "
                               "(its warm-up page hung); check the extractor")
        try:
            parent_end.recv()
        except EOFError:
            raise RuntimeError(f"extract: the extraction process exited while starting ({self._reap()})") from None

    def _drop_if_inherited(self) -> None:
        """Forget a child this process did not start: a process pool forked after this step ran in the
        driver (workers=1 earlier) copies it, and its workers must not share, kill or reap the driver's."""
        if self.process is not None and self.owner != os.getpid():
            self.conn.close()  # this process's copy of the socket; the driver's end stays open
            self.process = self.conn = None

    def _reap(self) -> str:
        """Wait for the dead child; how it ended."""
        process = self.process
        self.close()
        code = process.exitcode
        if code is not None and code < 0:
            return f"signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def close(self) -> None:
        """Kill the child (idle, or stuck in C code) and reap it."""
        self._drop_if_inherited()
        if self.process is None:
            return
        self.conn.close()
        self.process.kill()
        self.process.join()
        self.process = self.conn = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit multiprocessing reaps its daemon children itself
            pass


class HtmlExtract:
    """DocumentStep: replace an HTML document's text by its main text; other text passes unchanged."""

    name = "extract"

    def __init__(self, cfg: ExtractConfig, extractor: Callable[[str, bool], str] | None = None):
        self.cfg = cfg
        self.extractor = extractor or EXTRACTORS[cfg.extractor]
        self.sandbox = ExtractorSandbox(self.extractor, cfg.main_content, cfg.timeout_s) if cfg.timeout_s else None

    def __call__(self, doc: Document) -> str | None:
        ctype = doc.metadata.get("content_type")
        if not isinstance(ctype, str) or ctype.lower() in TEXT_TYPES:
            return None  # already text: JSONL, Parquet, plain-text files and payloads
        if ctype and ctype.lower() not in HTML_TYPES and self.cfg.html_only:
            return f"not-html: content type {ctype}"
        if not doc.text.strip():
            return "empty-page: no HTML"
        try:
            if self.sandbox is None:
                text = self.extractor(doc.text, self.cfg.main_content)
            else:
                text = self.sandbox.extract(doc.text)
        except ExtractionTimeout:
            return f"extraction-timeout: over {self.cfg.timeout_s:g} s"
        except ExtractionCrash as exc:
            return f"extraction-crash: {exc}"
        text = (text or "").strip()
        if len(text) < self.cfg.min_chars:
            return "empty-text: nothing left after extraction"
        doc.text = text
        return None

    def close(self) -> None:
        """Stop the extraction process (a later page starts a new one)."""
        if self.sandbox is not None:
            self.sandbox.close()
