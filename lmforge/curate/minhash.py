"""MinHash-LSH near-duplicate removal, as datatrove runs it for FineWeb.

Each document becomes a set of shingles: its normalised words, ``n_grams`` at a time
(Broder 1997). A MinHash signature keeps, for each of ``b·r`` permutations
``π_i(x) = (a_i·x + b_i) mod 2^32`` (a_i odd), the smallest permuted shingle hash; two
documents agree on one signature entry with probability equal to their Jaccard similarity ``s``.
LSH cuts the signature into ``b`` buckets of ``r`` hashes, and two documents become a
candidate pair when every hash of some bucket agrees, which happens with probability

    P(candidate | s) = 1 − (1 − s^r)^b          (Leskovec, Rajaraman & Ullman, MMDS §3.4)

With datatrove's defaults (5-grams, b = 14, r = 8) the curve's midpoint is
(1/b)^(1/r) ≈ 0.72 and P(candidate | s = 0.8) ≈ 0.92. Candidate pairs are joined into
clusters by union-find and one document per cluster is kept: the first in
(shard, index) order. The decision is by that position alone, never by document id: ids
repeat across inputs (per-file JSONL ids, ``name:line`` for files sharing a basename).

The work is staged like datatrove's four MinHash steps so that no process holds the
corpus: ``index_shard`` writes each shard's signatures, one sorted file per bucket;
``resolve`` merges the shards' files bucket by bucket (one ``pool_map`` task each, in
hash ranges that fit ``max_rows_in_memory``) into candidate pairs, then runs one
union-find over all pairs; ``apply_shard`` keeps each cluster's representative.

Differences from datatrove, all deliberate (most for speed: benchmarks/curate.py measures
signatures from text against datasketch on one core; the arithmetic is compiled loops,
``curate.minhash_kernels``):
- Words are the normalised text split on whitespace (datatrove uses a language-specific
  word tokenizer, spaCy for English). Punctuation is every Unicode punctuation, symbol and
  control character (datatrove lists about 80 characters).
- Each word is hashed once and ``n_grams`` consecutive word hashes are combined into the
  shingle hash, instead of hashing each joined n-gram string. The default word hash is a
  polynomial over the word's code points computed in one pass over the document
  (``polynomial_word_hashes``); ``hash: xxhash`` or ``sha1`` make one C call per word
  instead (slower). Signatures differ from datatrove's value by value while estimating the
  same Jaccard similarity.
- Permutations are affine maps mod 2^32 of the top 32 bits of the 64-bit shingle hash, in
  uint32 arithmetic (a multiply, an add and a minimum per shingle and permutation),
  instead of datatrove's ``(a·h + b) mod (2^61 − 1)`` on uint64. The guarantee P(entry agrees) = s needs each π_i to be a
  bijection of uniformly random hash values, which fmix64-finalised shingle hashes model
  (as datatrove's and datasketch's hashing does); the random (a_i, b_i) then only have to
  make the b·r minima behave as independent, as 2-universal affine families do on inputs
  with entropy (Mitzenmacher & Vadhan 2008, "Why simple hash functions work"). The tests
  check it: entries agree at rate s, bands at rate s^r, errors within the binomial spread.
  With 32-bit values two documents' different minima agree by chance with probability
  about (shingles / 2^32), far below the estimator's own error.
- A document with fewer words than ``n_grams`` is one shingle of all its words (datatrove
  gives it no signature, so it is never deduplicated). A document with no words at all
  gets no signature and is never a near-duplicate.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash

from lmforge.core.config import option, positive, seed_field
from lmforge.core.io import atomic_write_npy, atomic_write_text
from lmforge.curate import minhash_kernels as kernels
from lmforge.curate.base import PoolMap
from lmforge.data.documents import Document


@dataclass
class MinHashConfig:
    """MinHash-LSH near-dedup; the defaults are datatrove's (FineWeb) settings."""

    n_grams: int = positive(5, help="words per shingle")
    num_buckets: int = positive(14, help="LSH bands b; more bands catch lower similarities")
    hashes_per_bucket: int = positive(
        8, help="hashes per band r; pairs above a Jaccard similarity of about (1/b)^(1/r) (0.72 by default) are caught"
    )
    seed: int = seed_field(1, help="seeds the permutations (as datatrove's np.random.RandomState(seed))")
    hash: Literal["polynomial", "xxhash", "sha1"] = option(
        "polynomial",
        help="the 64-bit word hash: polynomial: over the code points, one compiled pass per document; xxhash, "
        "sha1 (its first 8 bytes): one call per word, slower",
    )
    normalize: bool = option(
        True, help="datatrove's TextNormConfig: lowercase, numbers to 0, no punctuation or diacritics, one space"
    )
    max_rows_in_memory: int = positive(
        4_000_000, help="signature rows one resolve task holds at once (about 80 bytes each)"
    )

    def __post_init__(self) -> None:
        for key in ("n_grams", "num_buckets", "hashes_per_bucket", "max_rows_in_memory"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"minhash.{key} must be a positive integer, got {value!r}")
        if self.hash not in ("polynomial", "xxhash", "sha1"):
            raise ValueError(f"minhash.hash must be 'polynomial', 'xxhash' or 'sha1', got {self.hash!r}")
        if self.seed < 0:
            raise ValueError(f"minhash.seed must be >= 0 (it seeds numpy's RandomState), got {self.seed}")

    @property
    def num_perm(self) -> int:
        return self.num_buckets * self.hashes_per_bucket

    @property
    def threshold(self) -> float:
        """Similarity where the LSH curve is steepest, (1/b)^(1/r)."""
        return (1 / self.num_buckets) ** (1 / self.hashes_per_bucket)


def candidate_probability(s: float | np.ndarray, num_buckets: int, hashes_per_bucket: int) -> float | np.ndarray:
    """P(two documents of Jaccard similarity s share a bucket) = 1 − (1 − s^r)^b."""
    return 1 - (1 - np.asarray(s, dtype=np.float64) ** hashes_per_bucket) ** num_buckets


# --------------------------------------------------------------------------- normalisation

_KEEP, _SPACE, _DIGIT, _MARK, _DECIMAL = 0, 1, 2, 3, 4
_DECIMAL_SEPARATORS = ".,،٫⎖⎗⎘"  # kept inside numbers, as datatrove's NUMBERS_PATTERN
_DROP = np.uint32(0xFFFFFFFF)  # marks a combining mark for removal


def _char_class(cp: int) -> int:
    c = chr(cp)
    if c in _DECIMAL_SEPARATORS:
        return _DECIMAL
    cat = unicodedata.category(c)
    if cat == "Nd":
        return _DIGIT
    if cat == "Mn":
        return _MARK
    if cat[0] in "PSZ" or cat == "Cc" or c.isspace():
        return _SPACE
    return _KEEP


def _replacement(cp: int) -> int:
    """What a lowercased, NFD code point becomes: 32 (space), 48 ("0"), 46 (".", any decimal
    separator: they are interchangeable in NUMBERS_PATTERN and all become spaces), _DROP (a mark),
    or itself."""
    cls = _char_class(cp)
    return {_SPACE: 32, _DIGIT: 48, _DECIMAL: 46, _MARK: int(_DROP)}.get(cls, cp)


@cache
def _bmp_replacements() -> np.ndarray:
    """``_replacement`` of each code point of the Basic Multilingual Plane (built once per process, ~50 ms)."""
    return np.fromiter((_replacement(cp) for cp in range(0x10000)), dtype=np.uint32, count=0x10000)


# bytes.translate table doing ``_replacement`` on ASCII, plus lowercasing (ASCII has no marks)
_ASCII_TABLE = bytes(32 if _char_class(cp) == _SPACE else 48 if _char_class(cp) == _DIGIT else ord(chr(cp).lower())
                     for cp in range(128)) + bytes(range(128, 256))


def simplified_codes(text: str) -> np.ndarray:
    """The code points of datatrove's ``simplify_text`` before the final whitespace collapse:
    lowercase, numbers -> "0", punctuation, symbols and whitespace -> " ", diacritics stripped
    (NFD, then combining marks dropped). uint8 when the text is ASCII, else uint32.

    Pure-ASCII text (most web text) is mapped by one C-speed ``bytes.translate``; other text
    through a code-point table with numpy; then one compiled pass collapses numbers
    (``minhash_kernels.collapse_numbers``).
    """
    if text.isascii():
        c = np.frombuffer(text.encode("ascii").translate(_ASCII_TABLE), dtype=np.uint8)
        return kernels.collapse_numbers(c, 46, 44)  # "." and "," are kept by the table, as decimal separators
    else:
        text = text.lower()
        if not unicodedata.is_normalized("NFD", text):
            text = unicodedata.normalize("NFD", text)
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        bmp = cps < 0x10000
        if bmp.all():
            c = _bmp_replacements()[cps]
        else:  # astral characters (emoji, rare scripts): map each distinct one
            c = np.empty(len(cps), dtype=np.uint32)
            c[bmp] = _bmp_replacements()[cps[bmp]]
            astral, inverse = np.unique(cps[~bmp], return_inverse=True)
            c[~bmp] = np.array([_replacement(int(x)) for x in astral], dtype=np.uint32)[inverse]
        if (c == _DROP).any():
            c = c[c != _DROP]
        return kernels.collapse_numbers(c, 46, 46)  # every decimal separator is "." by now


def _codes_text(c: np.ndarray) -> str:
    return c.tobytes().decode("ascii") if c.dtype == np.uint8 else c.astype("<u4").tobytes().decode("utf-32-le")


def simplified_text(text: str) -> str:
    """``simplified_codes`` as a string."""
    return _codes_text(simplified_codes(text))


def normalize_text(text: str) -> str:
    """The normalised text: ``normalized_words`` joined by single spaces."""
    return " ".join(normalized_words(text))


def normalized_words(text: str) -> list[str]:
    """The words of datatrove's ``simplify_text``: lowercase, numbers -> "0", punctuation and symbols -> space,
    diacritics stripped (NFD, then combining marks dropped), whitespace runs -> one space."""
    return simplified_text(text).split()


def document_words(text: str, normalize: bool = True) -> list[str]:
    return normalized_words(text) if normalize else text.split()


# --------------------------------------------------------------------------- shingles and signatures


def _sha1_64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "little")


def word_hashes(words: list[str], hash_fc: str = "xxhash") -> np.ndarray:
    """One 64-bit hash per word (C calls through ``map``, no Python loop body)."""
    fn = xxhash.xxh64_intdigest if hash_fc == "xxhash" else _sha1_64
    return np.fromiter(map(fn, map(str.encode, words)), dtype=np.uint64, count=len(words))


def polynomial_word_hashes(codes: np.ndarray) -> np.ndarray:
    """One 64-bit hash per word of a code-point array whose words are separated by runs of 32 (space).

    A word w_0..w_{L−1} hashes to fmix64(Σ_j (w_j + 1)·B^j + L·K mod 2^64) (B odd, K a fixed odd
    constant), in one compiled pass over the code points (``minhash_kernels.word_hashes``), where
    ``word_hashes`` makes one C call per word. Equal words get equal hashes; distinct words
    collide only when a polynomial with coefficients below 2^21 in absolute value vanishes mod
    2^64 at the fixed base B.
    """
    return kernels.word_hashes(codes)


def _text_codes(text: str) -> np.ndarray:
    """The code points of ``text`` (uint8 when it is ASCII, which is cheaper to build)."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def document_word_hashes(text: str, cfg: MinHashConfig) -> np.ndarray:
    """The 64-bit hashes of the document's (normalised) words, in order."""
    if cfg.hash != "polynomial":
        return word_hashes(document_words(text, cfg.normalize), cfg.hash)
    return polynomial_word_hashes(simplified_codes(text) if cfg.normalize else _text_codes(" ".join(text.split())))


def combine_ngrams(h: np.ndarray, n: int) -> np.ndarray:
    """Hashes of all runs of ``n`` consecutive items: fmix64(Σ_j h[i+j]·B^(n−1−j) mod 2^64).

    Fewer than ``n`` items make one shingle of all of them; none make none.
    """
    return kernels.combine_ngrams(np.ascontiguousarray(h, dtype=np.uint64), n)


def shingle_hashes(text: str, cfg: MinHashConfig) -> np.ndarray:
    """The document's distinct shingle hashes (uint64, sorted)."""
    return np.unique(combine_ngrams(document_word_hashes(text, cfg), cfg.n_grams))


@cache
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The affine maps' parameters, (num_perm,) uint32 each: a odd, b any, from RandomState(seed)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, dtype=np.uint64, size=num_perm) * np.uint64(2) + np.uint64(1)
    b = gen.randint(0, 1 << 32, dtype=np.uint64, size=num_perm)
    return a.astype(np.uint32), b.astype(np.uint32)


def shingles_signature(shingles: np.ndarray, cfg: MinHashConfig) -> np.ndarray:
    """The MinHash signature (b·r,) of one set of 64-bit shingle hashes: for each permutation the
    smallest π_i(x) = (a_i·x + b_i) mod 2^32 over the shingles' top 32 bits x (uint64 values)."""
    a, b = permutations(cfg.num_perm, cfg.seed)
    return kernels.min_permuted(np.ascontiguousarray(shingles, dtype=np.uint64), a, b).astype(np.uint64)


def share_a_bucket(sig_a: np.ndarray, sig_b: np.ndarray, cfg: MinHashConfig) -> bool:
    """Whether LSH makes the two documents a candidate pair: all r hashes of some bucket agree."""
    equal = (sig_a == sig_b).reshape(cfg.num_buckets, cfg.hashes_per_bucket)
    return bool(equal.all(axis=1).any())


def signatures(texts: list[str], cfg: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures (len(texts), b·r) uint64 (values below 2^32), and which documents have any words.

    Each document is one compiled call from its word hashes (shingles, then the permuted minima,
    ``minhash_kernels.signature_of_word_hashes``). A document's repeated shingles are not
    removed: they cannot change a minimum.
    """
    a, b = permutations(cfg.num_perm, cfg.seed)
    sigs = np.empty((len(texts), cfg.num_perm), dtype=np.uint64)
    has_words = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        h = document_word_hashes(text, cfg)
        has_words[i] = len(h) > 0
        sigs[i] = kernels.signature_of_word_hashes(h, cfg.n_grams, a, b)
    return sigs, has_words


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sets of shingle hashes (sorted unique arrays)."""
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b, assume_unique=True)) / union if union else 1.0


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of signature entries that agree: an unbiased estimate of the Jaccard similarity."""
    return float(np.mean(sig_a == sig_b))


# --------------------------------------------------------------------------- on-disk stages
#
# work_dir/ids/s{shard}.json              document ids of the shard, in order
# work_dir/sigs/b{bucket}/s{shard}.npy    (n, r + 2) uint64 rows [key, hash_1..hash_r, doc index], sorted
# work_dir/pairs/b{bucket}.npy            (m, 2) uint64 candidate pairs of global ids (shard << 32 | index)
# work_dir/clusters/s{shard}.json         members of clusters of size > 1: index, whether it is the one kept
#                                         (the cluster's first global id), the kept document's id, cluster size
# work_dir/summary.json                   counts


def _bucket_keys(rows: np.ndarray) -> np.ndarray:
    """A uniform 64-bit key per bucket signature, so a bucket can be split into equal hash ranges."""
    return kernels.row_keys(np.ascontiguousarray(rows, dtype=np.uint64))


class MinHashDedup:
    """Corpus step: drop all but the first document of each near-duplicate cluster."""

    name = "minhash"

    def __init__(self, cfg: MinHashConfig | None = None):
        self.cfg = cfg or MinHashConfig()

    # -- stage 1: signatures, one sorted file per bucket
    def index_shard(self, shard: int, docs: list[Document], work_dir: Path) -> None:
        cfg, r = self.cfg, self.cfg.hashes_per_bucket
        work_dir = Path(work_dir)
        sigs, has_words = signatures([d.text for d in docs], cfg)
        index = np.flatnonzero(has_words).astype(np.uint64)
        sigs = sigs[has_words]
        for bucket in range(cfg.num_buckets):
            band = sigs[:, bucket * r : (bucket + 1) * r]
            table = np.column_stack([_bucket_keys(band), band, index]) if len(index) else np.empty((0, r + 2), np.uint64)
            order = np.lexsort(table.T[::-1])  # rows in lexicographic order: key first, doc index last
            atomic_write_npy(work_dir / "sigs" / f"b{bucket:03d}" / f"s{shard:06d}.npy", table[order])
        atomic_write_text(work_dir / "ids" / f"s{shard:06d}.json", json.dumps([d.id for d in docs], ensure_ascii=False))

    # -- stages 2 and 3: candidate pairs per bucket, then one union-find
    def resolve(self, work_dir: Path, num_shards: int, pool_map: PoolMap) -> None:
        work_dir = Path(work_dir)
        task = partial(bucket_pairs, str(work_dir), num_shards, self.cfg.max_rows_in_memory)
        n_pairs = pool_map(task, list(range(self.cfg.num_buckets)))
        pairs = [np.load(work_dir / "pairs" / f"b{b:03d}.npy") for b in range(self.cfg.num_buckets)]
        members = cluster_pairs(np.concatenate(pairs) if pairs else np.empty((0, 2), np.uint64))
        by_shard: dict[int, dict[str, list]] = {}
        ids_cache: dict[int, list[str]] = {}
        for gid, root, size in members:
            shard, index = int(gid >> 32), int(gid & 0xFFFFFFFF)
            root_shard, root_index = int(root >> 32), int(root & 0xFFFFFFFF)
            if root_shard not in ids_cache:
                ids_cache[root_shard] = _read_ids(work_dir, root_shard)
            entry = by_shard.setdefault(shard, {"index": [], "keep": [], "kept": [], "size": []})
            entry["index"].append(index)
            entry["keep"].append(bool(gid == root))  # by position: ids need not be unique across inputs
            entry["kept"].append(ids_cache[root_shard][root_index])
            entry["size"].append(int(size))
        clusters_dir = work_dir / "clusters"
        for old in clusters_dir.glob("s*.json") if clusters_dir.is_dir() else []:
            old.unlink()  # a rerun must not see a previous run's clusters
        for shard, entry in by_shard.items():
            atomic_write_text(clusters_dir / f"s{shard:06d}.json", json.dumps(entry, ensure_ascii=False))
        n_clusters = len({int(root) for _, root, _ in members})
        atomic_write_text(work_dir / "summary.json", json.dumps({
            "candidate_pairs": int(sum(n_pairs)), "clusters": n_clusters,
            "documents_in_clusters": len(members), "removed": len(members) - n_clusters,
            "threshold": round(self.cfg.threshold, 4),
        }, indent=2) + "\n")

    # -- stage 4: keep one document per cluster
    def apply_shard(self, shard: int, docs: list[Document], work_dir: Path) -> list[str | None]:
        work_dir = Path(work_dir)
        indexed = _read_ids(work_dir, shard)
        if indexed != [d.id for d in docs]:
            raise RuntimeError(f"minhash: shard {shard} holds {len(docs)} documents but {len(indexed)} were indexed "
                               f"(or in another order); rerun the step's index phase")
        decisions: list[str | None] = [None] * len(docs)
        path = work_dir / "clusters" / f"s{shard:06d}.json"
        if not path.is_file():
            return decisions
        entry = json.loads(path.read_text(encoding="utf-8"))
        for index, keep, kept, size in zip(entry["index"], entry["keep"], entry["kept"], entry["size"]):
            doc = docs[index]
            doc.metadata["dup_cluster"] = kept
            doc.metadata["dup_cluster_size"] = size
            if not keep:
                decisions[index] = f"near-duplicate of {kept}"
        return decisions


def _read_ids(work_dir: Path, shard: int) -> list[str]:
    path = work_dir / "ids" / f"s{shard:06d}.json"
    if not path.is_file():
        raise RuntimeError(f"minhash: {path} is missing; index_shard has not run for shard {shard}")
    return json.loads(path.read_text(encoding="utf-8"))


def bucket_pairs(work_dir: str, num_shards: int, max_rows: int, bucket: int) -> int:
    """Stage 2 for one bucket: merge the shards' sorted signature files and write candidate pairs.

    Documents whose bucket signatures are equal form a run after sorting; each document is
    paired with the previous one of its run (a chain, as datatrove writes it), which is
    enough for union-find. The bucket is read in key ranges of at most about ``max_rows``
    rows, so memory stays bounded however many shards there are.
    """
    directory = Path(work_dir) / "sigs" / f"b{bucket:03d}"
    tables = []
    for shard in range(num_shards):
        path = directory / f"s{shard:06d}.npy"
        if not path.is_file():
            raise RuntimeError(f"minhash: {path} is missing; index_shard has not run for shard {shard}")
        tables.append((shard, np.load(path, mmap_mode="r")))
    total = sum(len(t) for _, t in tables)
    n_ranges = max(1, math.ceil(total / max_rows))
    bounds = [int(i * (2**64) // n_ranges) for i in range(n_ranges)] + [2**64]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        parts = []
        for shard, table in tables:
            keys = np.asarray(table[:, 0])
            start = np.searchsorted(keys, np.uint64(lo), side="left")
            stop = len(keys) if hi == 2**64 else np.searchsorted(keys, np.uint64(hi), side="left")
            if stop > start:
                part = np.array(table[start:stop])
                part[:, -1] |= np.uint64(shard) << np.uint64(32)  # doc index -> global id
                parts.append(part)
        if not parts:
            continue
        rows = np.concatenate(parts)
        rows = rows[np.lexsort(rows.T[::-1])]
        same = np.all(rows[1:, :-1] == rows[:-1, :-1], axis=1)
        out.append(np.column_stack([rows[:-1, -1][same], rows[1:, -1][same]]))
    pairs = np.concatenate(out) if out else np.empty((0, 2), np.uint64)
    atomic_write_npy(Path(work_dir) / "pairs" / f"b{bucket:03d}.npy", pairs.astype(np.uint64))
    return len(pairs)


def cluster_pairs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """Stage 3: union-find over candidate pairs of global ids.

    Returns ``(id, root, cluster size)`` for every id in a cluster of two or more, where the
    root is the smallest id of the cluster (the first document in (shard, index) order).
    """
    if len(pairs) == 0:
        return []
    pairs = np.unique(pairs, axis=0)
    nodes, inverse = np.unique(pairs, return_inverse=True)
    edges = inverse.reshape(-1, 2).tolist()
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:  # path compression
            parent[i], i = root, parent[i]
        return root

    for u, v in edges:
        ru, rv = find(u), find(v)
        if ru != rv:  # the smaller index (= smaller global id) becomes the root
            parent[max(ru, rv)] = min(ru, rv)
    roots = np.array([find(i) for i in range(len(nodes))])
    sizes = np.bincount(roots, minlength=len(nodes))
    return [(int(nodes[i]), int(nodes[roots[i]]), int(sizes[roots[i]])) for i in range(len(nodes))]
