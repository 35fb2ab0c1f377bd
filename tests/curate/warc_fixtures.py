"""Tiny WARC files for curation tests, written with warcio."""

from __future__ import annotations

import io
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

PROSE = {
    "en": ("The library opened a new reading room on the second floor last week. Visitors can borrow books, "
           "read newspapers and use the computers there until late in the evening. The staff said that the room "
           "was built with money raised by local families and that it will host talks and classes for children."),
    "fr": ("La bibliothèque a ouvert une nouvelle salle de lecture au deuxième étage la semaine dernière. Les "
           "visiteurs peuvent emprunter des livres, lire les journaux et utiliser les ordinateurs jusqu'au soir."),
}


def page(body: str, title: str = "Page") -> str:
    return (f"<html><head><title>{title}</title></head><body><nav>Home | About | Contact</nav>"
            f"<main><h1>{title}</h1><p>{body}</p></main><footer>Copyright</footer></body></html>")


def write_warc(path: Path, records: list[tuple[str, bytes, str]], gzip: bool = True) -> Path:
    """records: (url, payload, content type) as HTTP 200 responses, after a warcinfo record."""
    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=gzip)
        writer.write_record(writer.create_warcinfo_record(path.name, {"software": "tests"}))
        for url, payload, ctype in records:
            headers = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(payload),
                                                          http_headers=headers))
    return path


def html_record(url: str, body: str, title: str = "Page") -> tuple[str, bytes, str]:
    return url, page(body, title).encode("utf-8"), "text/html; charset=utf-8"


def record_offsets(path: Path) -> list[int]:
    """Where each record begins (in a .warc.gz written one gzip member per record: where its member begins)."""
    from fastwarc.warc import ArchiveIterator

    with open(path, "rb") as f:
        return [r.stream_pos for r in ArchiveIterator(f, parse_http=False)]


# an English page, a PNG and a French page in windows-1252
MIXED_PAGES = [html_record("https://x.org/a", PROSE["en"]), ("https://x.org/b", b"\x89PNG\r\n\0", "image/png"),
               ("https://x.org/c", PROSE["fr"].encode("cp1252"), "text/html; charset=windows-1252")]


def fixed_warc(records: list[tuple[str, bytes, str]], gzip: bool = True) -> bytes:
    """``write_warc``'s file as bytes, with fixed record ids and dates: the same bytes every run
    (for tests that cut or alter a WARC at chosen bytes)."""
    out = io.BytesIO()
    writer = WARCWriter(out, gzip=gzip)
    fixed = {"WARC-Date": "2024-01-01T00:00:00Z"}
    info = writer.create_warcinfo_record("fixed.warc", {"software": "tests"})
    for key, value in {**fixed, "WARC-Record-ID": "<urn:uuid:00000000-0000-0000-0000-000000000000>"}.items():
        info.rec_headers.replace_header(key, value)
    writer.write_record(info)
    for i, (url, payload, ctype) in enumerate(records, start=1):
        headers = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
        record_id = f"<urn:uuid:00000000-0000-0000-0000-{i:012d}>"
        writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(payload),
                                                      http_headers=headers,
                                                      warc_headers_dict={**fixed, "WARC-Record-ID": record_id}))
    return out.getvalue()
