"""MinHash-LSH near-dedup: estimator accuracy, LSH recall/precision, staged runs, normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmforge.curate.minhash import (
    MinHashConfig,
    MinHashDedup,
    candidate_probability,
    estimated_jaccard,
    jaccard,
    normalize_text,
    normalized_words,
    permutations,
    polynomial_word_hashes,
    share_a_bucket,
    shingle_hashes,
    shingles_signature,
    signatures,
    simplified_codes,
)
from lmforge.data.documents import Document


def sequential(fn, items):
    return [fn(x) for x in items]


def run_staged(docs: list[Document], shard_sizes: list[int], work_dir, cfg: MinHashConfig) -> list[str | None]:
    shards, start = [], 0
    for size in shard_sizes:
        shards.append(docs[start : start + size])
        start += size
    assert start == len(docs)
    step = MinHashDedup(cfg)
    for i, shard in enumerate(shards):
        step.index_shard(i, shard, work_dir)
    step.resolve(work_dir, len(shards), sequential)
    return [d for i, shard in enumerate(shards) for d in step.apply_shard(i, shard, work_dir)]


def edit_words(words: list[str], rate: float, rng: np.random.Generator) -> list[str]:
    """Replace each word with probability ``rate`` by a fresh random word."""
    out = list(words)
    for i in np.flatnonzero(rng.random(len(words)) < rate):
        out[i] = "w" + "".join(rng.choice(list("qxzjkv"), size=6))
    return out


def test_signature_is_the_minimum_of_affine_bijections_mod_2_32_seeded_by_random_state():
    """Replaces the check of datatrove's (a·h + b) mod (2^61 − 1) values: entry i of a signature is
    min over the shingles' top 32 bits x of (a_i·x + b_i) mod 2^32, a_i odd (a bijection), drawn
    from RandomState(seed) as datatrove's are; computed here with Python's integers."""
    a, b = permutations(112, 1)
    assert a.dtype == b.dtype == np.uint32 and np.all(a % 2 == 1)
    gen = np.random.RandomState(1)
    assert np.array_equal(a, gen.randint(0, 1 << 31, dtype=np.uint64, size=112) * 2 + 1)
    assert np.array_equal(b, gen.randint(0, 1 << 32, dtype=np.uint64, size=112))
    assert not np.array_equal(permutations(112, 2)[0], a)
    shingles = np.concatenate([np.random.default_rng(0).integers(0, 2**64, size=500, dtype=np.uint64),
                               np.array([0, 1 << 32, 2**63, 2**64 - 1], dtype=np.uint64)])
    x = [int(s) >> 32 for s in shingles]
    expected = [min((int(ai) * xj + int(bi)) % 2**32 for xj in x) for ai, bi in zip(a, b)]
    assert shingles_signature(shingles, MinHashConfig()).tolist() == expected
    for one in shingles[-4:]:  # a single shingle: each entry is its own image, a bijection of x
        assert shingles_signature(one[None], MinHashConfig()).tolist() == [(int(ai) * (int(one) >> 32) + int(bi)) % 2**32
                                                                           for ai, bi in zip(a, b)]
    assert shingles_signature(shingles[:0], MinHashConfig()).tolist() == [2**32 - 1] * 112  # no shingles


def test_signature_entries_agree_with_probability_jaccard_and_bands_with_s_to_the_r():
    """Over many random set pairs at J = 0.75, the 112 entries agree at rate J and a band of 8
    agrees at rate J^8: the permutations behave as independent ones."""
    cfg = MinHashConfig()
    rng = np.random.default_rng(5)
    agree, bands = [], []
    for _ in range(300):
        pool = rng.integers(0, 2**64, size=700, dtype=np.uint64)
        set_a, set_b = pool[:600], np.concatenate([pool[:500], pool[600:]])
        equal = shingles_signature(set_a, cfg) == shingles_signature(set_b, cfg)
        agree.append(equal.mean())
        bands.extend(equal.reshape(cfg.num_buckets, cfg.hashes_per_bucket).all(axis=1))
    j = 500 / 700
    assert abs(np.mean(agree) - j) <= 4 * math.sqrt(j * (1 - j) / (300 * 112))
    p = j**8
    assert abs(np.mean(bands) - p) <= 4 * math.sqrt(p * (1 - p) / len(bands))
    # entries of one signature are not correlated beyond the binomial spread
    assert np.std(agree) == pytest.approx(math.sqrt(j * (1 - j) / 112), rel=0.25)


def test_polynomial_word_hashes_equal_exactly_for_equal_words(corpus_texts):
    seen: dict[str, int] = {}
    for text in [*corpus_texts, "x" * 70_000 + " long " + "y" * 70_000, "  leading  and   trailing  "]:
        words = normalized_words(text)
        hashes = polynomial_word_hashes(simplified_codes(text))
        assert len(hashes) == len(words)
        for word, h in zip(words, hashes.tolist()):
            assert seen.setdefault(word, h) == h
    assert len(set(seen.values())) == len(seen)  # no collisions among the corpus's distinct words


def test_lsh_curve_matches_datatrove_comment():
    cfg = MinHashConfig()
    assert cfg.num_perm == 112
    assert cfg.threshold == pytest.approx(0.719, abs=1e-3)
    assert candidate_probability(0.8, 14, 8) == pytest.approx(0.924, abs=1e-3)


def test_jaccard_estimates_within_binomial_error_on_random_sets():
    cfg = MinHashConfig()
    rng = np.random.default_rng(1)
    errors = []
    for target in (0.1, 0.3, 0.5, 0.7, 0.9):
        for _ in range(12):
            union = int(rng.integers(300, 2000))
            common = int(round(target * union))
            pool = rng.integers(0, 2**64, size=union, dtype=np.uint64)
            only = union - common
            set_a = np.unique(pool[: common + only // 2])
            set_b = np.unique(np.concatenate([pool[:common], pool[common + only // 2 :]]))
            exact = jaccard(set_a, set_b)
            est = estimated_jaccard(shingles_signature(set_a, cfg), shingles_signature(set_b, cfg))
            sigma = math.sqrt(exact * (1 - exact) / cfg.num_perm)
            assert abs(est - exact) <= 4 * sigma, (exact, est)
            errors.append((est - exact) / sigma)
    # unbiased: the mean standardised error of 60 pairs is within 4 standard errors of 0
    assert abs(np.mean(errors)) <= 4 / math.sqrt(len(errors))


def test_lsh_recall_and_precision_on_edited_near_duplicates(corpus_texts):
    """Pairs (document, randomly edited copy) labelled by exact shingle Jaccard:
    duplicates at J >= 0.8, non-duplicates at J <= 0.5 (pairs in between are not scored)."""
    cfg = MinHashConfig()
    rng = np.random.default_rng(2)
    bases = [t for t in corpus_texts if len(normalize_text(t).split()) >= 200][:40]
    originals, copies = [], []
    for text in bases:
        words = normalize_text(text).split()
        for rate in (rng.uniform(0.002, 0.03), rng.uniform(0.003, 0.03), rng.uniform(0.08, 0.2), rng.uniform(0.08, 0.2)):
            originals.append(text)
            copies.append(" ".join(edit_words(words, rate, rng)))
    sig_o, _ = signatures(originals, cfg)
    sig_c, _ = signatures(copies, cfg)
    tp = fn = fp = tn = 0
    for i in range(len(originals)):
        j = jaccard(shingle_hashes(originals[i], cfg), shingle_hashes(copies[i], cfg))
        found = share_a_bucket(sig_o[i], sig_c[i], cfg)
        if j >= 0.8:
            tp, fn = tp + found, fn + (not found)
        elif j <= 0.5:
            fp, tn = fp + found, tn + (not found)
    assert tp + fn >= 50 and fp + tn >= 50  # enough labelled pairs on both sides
    recall, precision = tp / (tp + fn), tp / (tp + fp)
    print(f"duplicates {tp + fn}, non-duplicates {fp + tn}, recall {recall:.3f}, precision {precision:.3f}")
    assert recall >= 0.95, (tp, fn)
    assert precision >= 0.95, (tp, fp)


def _corpus_with_duplicates(corpus_texts) -> list[Document]:
    rng = np.random.default_rng(3)
    docs = []
    for i, text in enumerate(corpus_texts[:24]):
        docs.append(Document(f"doc{i}", text))
        if i % 3 == 0:  # a light edit: a near-duplicate
            docs.append(Document(f"doc{i}-edit", " ".join(edit_words(text.split(), 0.01, rng))))
        if i % 4 == 0:  # an exact copy with different punctuation and case
            docs.append(Document(f"doc{i}-copy", text.upper().replace(",", ";")))
    docs.append(Document("short-a", "Hello, world!"))
    docs.append(Document("short-b", "hello world"))
    docs.append(Document("empty", "... !!!"))
    order = np.random.default_rng(4).permutation(len(docs))
    return [docs[i] for i in order]


def test_staged_run_over_shards_equals_single_shard(corpus_texts, tmp_path):
    docs = _corpus_with_duplicates(corpus_texts)
    n = len(docs)
    single_docs = [Document(d.id, d.text) for d in docs]
    single = run_staged(single_docs, [n], tmp_path / "one", MinHashConfig())
    many_docs = [Document(d.id, d.text) for d in docs]
    sizes = [7, 0, n // 2 - 7, n - n // 2]  # uneven, with an empty shard
    cfg = MinHashConfig(max_rows_in_memory=5)  # forces each bucket to be merged in many hash ranges
    many = run_staged(many_docs, sizes, tmp_path / "many", cfg)
    assert many == single
    assert sum(d is not None for d in single) >= 10
    assert [d.metadata for d in many_docs] == [d.metadata for d in single_docs]


def test_one_document_per_cluster_is_kept_the_first_in_order(corpus_texts, tmp_path):
    docs = _corpus_with_duplicates(corpus_texts)
    decisions = run_staged(docs, [len(docs)], tmp_path, MinHashConfig())
    position = {d.id: i for i, d in enumerate(docs)}
    clusters: dict[str, list[tuple[Document, str | None]]] = {}
    for doc, decision in zip(docs, decisions):
        if "dup_cluster" in doc.metadata:
            clusters.setdefault(doc.metadata["dup_cluster"], []).append((doc, decision))
        else:
            assert decision is None
    assert clusters
    for kept_id, members in clusters.items():
        assert len(members) == members[0][0].metadata["dup_cluster_size"] >= 2
        first = min(members, key=lambda m: position[m[0].id])[0]
        assert first.id == kept_id
        for doc, decision in members:
            assert decision == (None if doc.id == kept_id else f"near-duplicate of {kept_id}")
    by_id = {d.id: d for d in docs}
    # every planted duplicate was found, and the two short documents (one shingle each) match
    for doc in docs:
        if doc.id.endswith(("-edit", "-copy")):
            assert by_id[doc.id].metadata.get("dup_cluster") == by_id[doc.id.rsplit("-", 1)[0]].metadata.get("dup_cluster")
            assert "dup_cluster" in doc.metadata
    assert by_id["short-a"].metadata["dup_cluster"] == by_id["short-b"].metadata["dup_cluster"]
    assert "dup_cluster" not in by_id["empty"].metadata  # no words, no signature


def test_colliding_ids_do_not_keep_duplicates_the_first_position_is_kept(corpus_texts, tmp_path):
    # two inputs with per-file ids "1" and "2": the copies in the second shard carry the same ids
    a, b = corpus_texts[0], corpus_texts[1]
    docs = [Document("1", a), Document("2", b), Document("1", a), Document("2", b), Document("1", a)]
    decisions = run_staged(docs, [2, 3], tmp_path, MinHashConfig())
    assert decisions == [None, None, "near-duplicate of 1", "near-duplicate of 2", "near-duplicate of 1"]
    assert [(d.metadata["dup_cluster"], d.metadata["dup_cluster_size"]) for d in docs] == \
        [("1", 3), ("2", 2), ("1", 3), ("2", 2), ("1", 3)]


def test_apply_shard_refuses_documents_it_did_not_index(corpus_texts, tmp_path):
    docs = [Document(f"d{i}", t) for i, t in enumerate(corpus_texts[:5])]
    step = MinHashDedup(MinHashConfig())
    step.index_shard(0, docs, tmp_path)
    step.resolve(tmp_path, 1, sequential)
    with pytest.raises(RuntimeError, match="index phase"):
        step.apply_shard(0, docs[:4], tmp_path)


def test_normalisation_follows_datatrove_text_norm():
    assert normalize_text("  Héllo,\tWÖRLD!\n") == "hello world"
    # the ASCII fast path and the code-point path agree (a non-ASCII space sends text to the latter)
    for text in ("pi is 3.14, e is 2,718 and 1,000,000 has 7 digits", "v1.2.3.4 a1,2,3b 00.0 0..0 .5 7. x-Y_z"):
        assert normalize_text(text) == normalize_text(text.replace(" ", "\u2003"))
    assert normalize_text("pi is 3.14, e is 2,718 and 1,000,000 has 7 digits") == "pi is 0 e is 0 and 0 0 has 0 digits"
    assert normalize_text("v1.2.3 — “quoted” (naïve) café's") == "v0 0 quoted naive cafe s"
    assert normalize_text("١٢٣ apples") == "0 apples"  # digits of any script


def test_short_documents_are_one_shingle_and_normalisation_can_be_turned_off():
    cfg = MinHashConfig()
    assert len(shingle_hashes("Three short words", cfg)) == 1
    assert np.array_equal(shingle_hashes("Three short words", cfg), shingle_hashes("three, SHORT words!", cfg))
    assert not np.array_equal(shingle_hashes("three short words", cfg), shingle_hashes("three short word", cfg))
    raw = MinHashConfig(normalize=False)
    assert not np.array_equal(shingle_hashes("Three short words", raw), shingle_hashes("three, SHORT words!", raw))
    assert len(shingle_hashes("one two three four five six seven", cfg)) == 3
    sigs, has_words = signatures(["", "?!", "a b c d e f"], cfg)
    assert has_words.tolist() == [False, False, True]


def test_sha1_and_xxhash_word_hashes_give_the_same_estimates():
    text = " ".join(f"word{i}" for i in range(400))
    other = " ".join(f"word{i}" if i % 50 else "changed" for i in range(400))
    for cfg in (MinHashConfig(hash="sha1"), MinHashConfig(hash="xxhash"), MinHashConfig()):
        sig, _ = signatures([text, other], cfg)
        exact = jaccard(shingle_hashes(text, cfg), shingle_hashes(other, cfg))
        assert abs(estimated_jaccard(sig[0], sig[1]) - exact) <= 4 * math.sqrt(exact * (1 - exact) / 112)


@pytest.mark.parametrize("bad", [dict(n_grams=0), dict(num_buckets=-1), dict(hash="md5"), dict(seed=-1),
                                 dict(hashes_per_bucket=2.5)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="minhash"):
        MinHashConfig(**bad)
