"""MinHash's arithmetic as compiled loops (numba): word hashes, shingle hashes and permuted minima.

Each is a plain loop over one document's arrays that numba compiles to machine code once per
process (``cache=True`` keeps the compiled code on disk beside this file, or in ``NUMBA_CACHE_DIR``),
so a document costs one pass over its code points and one over its shingles x permutations, the
inner loop over permutations vectorised. The numbers are the scheme ``curate.minhash`` documents:
only how they are computed lives here. Arithmetic is on uint64 / uint32 and wraps, which is the
``mod 2^64`` / ``mod 2^32`` of the formulas; every constant is typed so that no operand is promoted.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_SPACE = np.uint32(32)
_ONE = np.uint64(1)
_SHIFT33 = np.uint64(33)
_SHIFT32 = np.uint64(32)
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
POLY_BASE = np.uint64(0x100000001B3)  # odd (FNV-1's 64-bit prime)
LENGTH_MIX = np.uint64(0xC2B2AE3D27D4EB4F)
SHINGLE_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection mod 2^64
MAX_UINT32 = np.uint32(0xFFFFFFFF)


@njit(cache=True, inline="always")
def fmix64(x: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finaliser, an avalanching bijection."""
    x ^= x >> _SHIFT33
    x *= _FMIX_1
    x ^= x >> _SHIFT33
    x *= _FMIX_2
    return x ^ (x >> _SHIFT33)


@njit(cache=True)
def word_hashes(codes: np.ndarray) -> np.ndarray:
    """One 64-bit hash per word of a code-point array whose words are separated by runs of 32 (space):
    fmix64(Σ_j (w_j + 1)·B^j + L·K mod 2^64) for the word w_0..w_{L−1} (``minhash.polynomial_word_hashes``)."""
    out = np.empty(len(codes) // 2 + 1, dtype=np.uint64)
    n = 0
    acc = np.uint64(0)
    power = _ONE
    length = np.uint64(0)
    for c in codes:
        if c == _SPACE:
            if length:
                out[n] = fmix64(acc + length * LENGTH_MIX)
                n += 1
                acc, power, length = np.uint64(0), _ONE, np.uint64(0)
        else:
            acc += (np.uint64(c) + _ONE) * power
            power *= POLY_BASE
            length += _ONE
    if length:
        out[n] = fmix64(acc + length * LENGTH_MIX)
        n += 1
    return out[:n]


@njit(cache=True)
def combine_ngrams(h: np.ndarray, n: int) -> np.ndarray:
    """Hashes of all runs of ``n`` consecutive items: fmix64(Σ_j h[i+j]·B^(n−1−j) mod 2^64);
    fewer than ``n`` items make one shingle of all of them, none make none."""
    if len(h) == 0:
        return h[:0].copy()
    n = min(n, len(h))
    m = len(h) - n + 1
    out = np.empty(m, dtype=np.uint64)
    for i in range(m):
        acc = h[i]
        for j in range(1, n):
            acc = acc * SHINGLE_BASE + h[i + j]
        out[i] = fmix64(acc)
    return out


@njit(cache=True)
def min_permuted(shingles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min over the shingles x of π_i(x) = (a_i·x + b_i) mod 2^32, x the top 32 bits of each
    64-bit shingle hash, for every permutation i (uint32, len(a)); 2^32 − 1 for no shingles."""
    sig = np.full(len(a), MAX_UINT32, dtype=np.uint32)
    for s in shingles:
        x = np.uint32(s >> _SHIFT32)
        for i in range(len(a)):
            v = np.uint32(a[i] * x + b[i])  # numba computes in 64 bits: the cast is the mod 2^32
            if v < sig[i]:
                sig[i] = v
    return sig


@njit(cache=True)
def signature_of_word_hashes(h: np.ndarray, n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A document's MinHash signature from its word hashes: ``min_permuted`` of its ``n``-gram shingles."""
    return min_permuted(combine_ngrams(h, n), a, b)


@njit(cache=True)
def row_keys(rows: np.ndarray) -> np.ndarray:
    """One 64-bit key per row of a (n, k) uint64 array: fmix64(Σ_j row_j·B^(k−1−j) mod 2^64)."""
    out = np.empty(rows.shape[0], dtype=np.uint64)
    for i in range(rows.shape[0]):
        acc = rows[i, 0]
        for j in range(1, rows.shape[1]):
            acc = acc * SHINGLE_BASE + rows[i, j]
        out[i] = fmix64(acc)
    return out


_ZERO = np.uint32(48)


@njit(cache=True)
def collapse_numbers(c: np.ndarray, sep_a: int, sep_b: int) -> np.ndarray:
    """datatrove's ``NUMBERS_PATTERN.sub("0", ·)`` on code points whose digits are already "0": each
    match of ``0+([sep]0+)?`` becomes one "0", scanning left to right as the regex does (it resumes
    after a match, so in "0.0.0" the second separator starts no match); then every separator left
    (code ``sep_a`` or ``sep_b``) becomes a space. Same dtype as ``c``."""
    out = np.empty_like(c)
    n, i, end = 0, 0, len(c)
    while i < end:
        x = c[i]
        if x == _ZERO:
            while i < end and c[i] == _ZERO:
                i += 1
            if i + 1 < end and (c[i] == sep_a or c[i] == sep_b) and c[i + 1] == _ZERO:
                i += 1
                while i < end and c[i] == _ZERO:
                    i += 1
            out[n] = _ZERO
        else:
            out[n] = _SPACE if x == sep_a or x == sep_b else x
            i += 1
        n += 1
    return out[:n]
