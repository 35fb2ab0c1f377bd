import gc
import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from lmforge.curate import extract, tasks
from lmforge.curate.extract import ExtractConfig, HtmlExtract
from lmforge.curate.langid import LanguageConfig, LanguageFilter
from lmforge.curate.pipeline import CurateConfig, run_curate
from lmforge.curate.readers import InputsConfig
from lmforge.data.documents import Document
from tests.curate.warc_fixtures import PROSE, html_record, page, write_warc


def spin_in_c(iterations: int) -> None:
    """One C call (PBKDF2) that returns to Python only when done, so no signal handler runs before."""
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", iterations)


def fake_extractor(html: str, main_content: bool) -> str:
    """The ``<p>`` text and the extracting process's id; "hang" spins in C for minutes, "crash" dies as if
    OOM-killed, "boom" raises."""
    if "hang" in html:
        spin_in_c(2**31 - 1)  # about half an hour
    if "crash" in html:
        os.kill(os.getpid(), signal.SIGKILL)
    if "boom" in html:
        raise ValueError("boom")
    return f"{html.replace('<p>', '').replace('</p>', '')} pid {os.getpid()}"


def html_doc(text: str) -> Document:
    return Document("d", f"<p>{text}</p>", {"content_type": "text/html"})


def gone(pid: int) -> bool:
    """Neither running nor a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


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


def test_the_fake_hang_is_one_that_a_sigalrm_time_limit_cannot_cut_short():
    t0 = time.perf_counter()
    spin_in_c(100_000)
    iterations = int(100_000 * 0.4 / (time.perf_counter() - t0))  # about 0.4 s
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.perf_counter() - t0))
    try:
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        spin_in_c(iterations)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired and fired[0] > 0.2  # due at 0.05 s, the handler ran only once the C call returned


def test_a_page_that_hangs_in_c_code_is_rejected_and_the_next_page_extracts_in_a_fresh_process():
    step = HtmlExtract(ExtractConfig(timeout_s=0.3), extractor=fake_extractor)
    first = html_doc("first")
    assert step(first) is None
    pid = step.sandbox.process.pid
    assert first.text == f"first pid {pid}" and pid != os.getpid()
    t0 = time.perf_counter()
    assert step(html_doc("hang")) == "extraction-timeout: over 0.3 s" and time.perf_counter() - t0 < 2
    assert gone(pid)  # killed and reaped
    after = html_doc("after")
    assert step(after) is None and after.text == f"after pid {step.sandbox.process.pid}" and step.sandbox.starts == 2
    step.close()


def test_a_page_that_kills_the_process_is_rejected_and_the_next_page_extracts():
    step = HtmlExtract(ExtractConfig(), extractor=fake_extractor)
    assert step(html_doc("crash")) == "extraction-crash: the extraction process died (signal SIGKILL)"
    assert step(html_doc("after")) is None and step.sandbox.starts == 2
    step.close()


def test_one_process_serves_every_page_and_close_or_dropping_the_step_reaps_it():
    step = HtmlExtract(ExtractConfig(), extractor=fake_extractor)
    docs = [html_doc(f"page {i}") for i in range(20)]
    assert all(step(d) is None for d in docs)
    pid = step.sandbox.process.pid
    assert {d.text.rsplit(" ", 1)[1] for d in docs} == {str(pid)} and step.sandbox.starts == 1
    step.close()
    assert gone(pid) and step(html_doc("again")) is None and step.sandbox.starts == 2  # a later page starts anew
    pid = step.sandbox.process.pid
    del step
    gc.collect()
    assert gone(pid)


def test_an_extractor_error_reaches_the_pipeline_and_the_process_keeps_serving():
    step = HtmlExtract(ExtractConfig(), extractor=fake_extractor)
    assert tasks.apply_steps(html_doc("boom"), [("extract", step)]) == ("extract", "step-error: ValueError: boom")
    assert step(html_doc("after")) is None and step.sandbox.starts == 1
    step.close()


def test_the_time_limit_holds_off_the_main_thread_and_timeout_0_extracts_in_process():
    step = HtmlExtract(ExtractConfig(timeout_s=0.2), extractor=fake_extractor)
    reasons = []
    thread = threading.Thread(target=lambda: reasons.append(step(html_doc("hang"))))
    thread.start()
    thread.join(5)
    assert reasons == ["extraction-timeout: over 0.2 s"]
    step.close()
    inline = HtmlExtract(ExtractConfig(timeout_s=0), extractor=fake_extractor)
    doc = html_doc("x")
    assert inline(doc) is None and doc.text == f"x pid {os.getpid()}" and inline.sandbox is None


INHERITED: list[HtmlExtract] = []  # a step a forked pool worker finds already built, as tasks._BUILT


def extract_in_forked_worker(text: str) -> str:
    doc = html_doc(text)
    assert INHERITED[0](doc) is None
    return doc.text


def test_a_forked_worker_starts_its_own_extraction_process_and_leaves_the_parents_alone():
    step = HtmlExtract(ExtractConfig(), extractor=fake_extractor)
    assert step(html_doc("parent")) is None
    parents = step.sandbox.process.pid
    INHERITED.append(step)
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            workers = int(pool.submit(extract_in_forked_worker, "worker").result().rsplit(" ", 1)[1])
    finally:
        INHERITED.clear()
    assert workers != parents and gone(workers)  # the worker's own child, reaped when the worker exited
    doc = html_doc("parent again")
    assert step(doc) is None and doc.text == f"parent again pid {parents}" and step.sandbox.starts == 1
    step.close()


def test_a_run_rejects_the_hanging_page_and_leaves_no_extraction_process(tmp_path, monkeypatch):
    monkeypatch.setitem(extract.EXTRACTORS, "resiliparse", fake_extractor)  # inherited by the forked workers
    records = [html_record(f"https://x.org/{i}", "hang" if i == 2 else f"page {i}") for i in range(6)]
    warc = write_warc(tmp_path / "c.warc.gz", records)
    for workers in (2, 1):
        run_dir = tmp_path / f"run{workers}"
        cfg = CurateConfig(run_dir=str(run_dir), steps=[{"type": "extract", "timeout_s": 0.5, "main_content": False}],
                           workers=workers, output_format="jsonl",
                           inputs=InputsConfig(paths=[str(warc)], records_per_shard=2))
        stats = run_curate(cfg)
        assert stats["kept"] == 5 and stats["rejected"] == 1
        texts = [r["text"] for p in sorted((run_dir / "output").iterdir()) for r in map(json.loads, p.open())]
        pids = {int(t.rsplit(" ", 1)[1]) for t in texts}
        rejects = [r for p in (run_dir / "rejects").iterdir() for r in map(json.loads, p.open())]
        assert [r["reason"] for r in rejects] == ["extraction-timeout: over 0.5 s"], rejects
        assert all(gone(pid) for pid in pids)  # workers=1 too: run_curate closes the steps it built here
        assert tasks._BUILT == {}  # and forgets them


def test_language_is_annotated_and_filtered_by_set_and_threshold():
    step = LanguageFilter(LanguageConfig(languages=["en"], threshold=0.65))
    en, fr = Document("e", PROSE["en"]), Document("f", PROSE["fr"])
    assert step(en) is None and en.metadata["language"] == "en" and en.metadata["language_score"] > 0.9
    assert step(fr).startswith("language: fr") and fr.metadata["language"] == "fr"
    assert LanguageFilter(LanguageConfig(languages=[]))(Document("f", PROSE["fr"])) is None  # any language
    strict = LanguageFilter(LanguageConfig(languages=["en"], threshold=0.999999))
    assert strict(Document("m", "ok ok computer")).startswith(("language_score", "language:"))


class NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_an_extractor_error_that_does_not_unpickle_keeps_its_name_and_message(monkeypatch):
    def fails(html, main_content):
        raise NeedsTwo("x", "y")

    monkeypatch.setitem(extract.EXTRACTORS, "resiliparse", fails)
    step = HtmlExtract(ExtractConfig(timeout_s=5))
    try:
        assert tasks.apply_steps(html_doc("a"), [("extract", step)]) == ("extract", "step-error: NeedsTwo: x and y")
    finally:
        step.close()
