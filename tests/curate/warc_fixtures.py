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
