"""MinHash signature throughput against datasketch 2.0, and `lmforge curate` end to end.

    python benchmarks/curate.py [--repeats 3] [--skip-pipeline]

Documents: the pages of data/web/debian-handbook.warc.gz (resiliparse, main content) plus
data/pretrain/*.jsonl cut into pieces of about a page (7,000 characters), single process.

Signatures, documents/s on one core, 112 permutations (14 buckets x 8):
- lmforge: ``minhash.signatures`` from the raw text: normalisation, polynomial word
  hashes, 5-gram shingle hashes, affine permutations ``(a·x + b) mod 2^32`` in uint32
  (compiled loops, ``curate.minhash_kernels``).
- datasketch 2.0 ``MinHash(num_perm=112).update_batch(shingles)`` on the same shingles
  (lmforge's normalised words, 5 at a time, joined with spaces, as UTF-8 bytes), with its
  default hash (SHA-1, 32-bit, ``affine32`` permutations) and with ``xxh64`` +
  ``affine64`` (64-bit like ours). Two peer figures each: "from text" includes building
  the shingle bytes from the same normalised words (what a user must do), "signature
  only" starts from the prebuilt shingles; lmforge's "signature only" starts from its
  normalised text (``normalize=False`` on it: words still to split and hash). The headline ratio is from text, against datasketch's default.

End to end: ``lmforge.stages.curate.run`` on recipes/demo/curate.yaml (extraction,
language ID, filters, exact dedup, MinHash; its own worker count), input documents/s.
Runs alternate and the best of N is kept (a first call compiles the kernels before any timing).
Target: lmforge >= 10x datasketch from text (issue 39).
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import xxhash
from datasketch import MinHash
from record import command, commit, machine, now

from lmforge.curate.minhash import MinHashConfig, normalize_text, normalized_words, signatures


def web_pages(path: str) -> list[str]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    texts = []
    with open(path, "rb") as f:
        for record in ArchiveIterator(f, record_types=WarcRecordType.response, parse_http=True):
            html = record.reader.read().decode("utf-8", "replace")
            texts.append(extract_plain_text(HTMLTree.parse(html), main_content=True))
    return texts


def page_pieces(pattern: str, size: int = 7000) -> list[str]:
    """JSONL documents cut at paragraph boundaries into pieces of about ``size`` characters."""
    pieces = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                piece = ""
                for para in json.loads(line)["text"].split("\n\n"):
                    piece = f"{piece}\n\n{para}" if piece else para
                    if len(piece) >= size:
                        pieces.append(piece)
                        piece = ""
                if piece:
                    pieces.append(piece)
    return pieces


def shingle_bytes(words: list[str], n: int = 5) -> list[bytes]:
    if len(words) < n:
        return [" ".join(words).encode()] if words else []
    return [" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)]


def datasketch_run(shingles: list[list[bytes]], **kwargs) -> None:
    for sh in shingles:
        m = MinHash(num_perm=112, **kwargs)
        m.update_batch(sh)


PEERS = {
    "datasketch sha1 (default)": {},
    "datasketch xxh64 affine64": {"hashfunc": xxhash.xxh64_intdigest, "scheme": "affine64"},
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pipeline_docs_per_s(recipe_path: str) -> dict:
    from lmforge.core.config import load_config
    from lmforge.stages import curate

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_config(curate.RECIPE, recipe_path, [f"run_dir={tmp}/run"])
        t0 = time.perf_counter()
        result = curate.run(recipe)
        seconds = time.perf_counter() - t0
    n_in = result["documents"]
    return {"seconds": round(seconds, 3), "input_documents": n_in, "kept": result["kept"],
            "workers": recipe.workers, "docs_per_s": round(n_in / seconds, 1), "dedup": result.get("dedup")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warc", default="data/web/debian-handbook.warc.gz")
    parser.add_argument("--pretrain", default="data/pretrain/*.jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recipe", default="recipes/demo/curate.yaml")
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/curate.json")
    args = parser.parse_args()

    started = now()
    texts = web_pages(args.warc) + page_pieces(args.pretrain)
    cfg = MinHashConfig()
    words = [normalized_words(t) for t in texts]
    normalised = [normalize_text(t) for t in texts]
    raw = MinHashConfig(normalize=False)  # words = str.split() of the already normalised text
    shingles = [shingle_bytes(w) for w in words]
    n_docs, n_bytes = len(texts), sum(len(t.encode("utf-8")) for t in texts)
    signatures(texts[:5], cfg)  # warm caches (character table, permutations) and load the compiled kernels
    signatures(normalised[:5], raw)

    sides = {"lmforge": lambda: signatures(texts, cfg), "lmforge signature only": lambda: signatures(normalised, raw)}
    for name, kwargs in PEERS.items():
        sides[name] = (lambda kw=kwargs: datasketch_run([shingle_bytes(normalized_words(t)) for t in texts], **kw))
        sides[f"{name} signature only"] = lambda kw=kwargs: datasketch_run(shingles, **kw)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            times[name].append(timed(fn))
    rate = {k: n_docs / min(v) for k, v in times.items()}

    ours, ours_sig = rate["lmforge"], rate["lmforge signature only"]
    rows = [("lmforge", ours, None, None)]
    for name in PEERS:
        rows.append((name, rate[name], ours / rate[name], ours_sig / rate[f"{name} signature only"]))
    headline = ours / rate["datasketch sha1 (default)"]
    result = {
        "benchmark": "curate",
        "date": started,
        "command": command("curate.py", None),
        "commit": commit(),
        "documents": n_docs,
        "text_megabytes": round(n_bytes / 1e6, 3),
        "mean_words_per_document": round(float(np.mean([len(w) for w in words])), 1),
        "minhash": {"num_perm": cfg.num_perm, "n_grams": cfg.n_grams, "docs_per_s": {k: round(v, 1) for k, v in rate.items()},
                    "ratio_from_text": {name: round(ours / rate[name], 3) for name in PEERS},
                    "ratio_signature_only": {name: round(ours_sig / rate[f"{name} signature only"], 3) for name in PEERS}},
        "ratio": round(headline, 3),
        "target_ratio": 10.0,
        "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "machine": {**machine(), "numpy": np.__version__, "numba": numba.__version__},
    }
    print(f"{n_docs} documents, {n_bytes / 1e6:.1f} MB, {result['mean_words_per_document']:.0f} words each; one core")
    print(f"{'':34}{'docs/s':>10}{'ratio (text)':>14}{'ratio (sig)':>13}")
    for name, r, from_text, sig_only in rows:
        print(f"{name:34}{r:>10.0f}" + (f"{from_text:>14.2f}{sig_only:>13.2f}" if from_text else ""))
    print(f"{'lmforge signature only':34}{ours_sig:>10.0f}")
    print(f"headline ratio vs datasketch default, from text: {headline:.2f} (target >= 10)")

    if not args.skip_pipeline:
        if Path(args.recipe).is_file():
            result["pipeline"] = pipeline_docs_per_s(args.recipe)
            print(f"lmforge curate {args.recipe}: {result['pipeline']}")
        else:
            result["pipeline"] = f"pending: {args.recipe} does not exist"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
