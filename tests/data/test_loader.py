from collections import Counter

import numpy as np
import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader, window_starts
from lmforge.data.shards import open_shards
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, small_tokenizer_dir, corpus_texts):
    """Two prepared datasets: the corpus, and a second one of short synthetic documents."""
    root = tmp_path_factory.mktemp("datasets")
    a = write_jsonl(root / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(corpus_texts)])
    b = write_jsonl(root / "b.jsonl", [{"id": f"b{i}", "text": f"Note {i}: " + "la " * (i % 5 + 1)} for i in range(400)])
    out = []
    for name, path in (("A", a), ("B", b)):
        run_prepare(PrepareRecipe(run_dir=str(root / name), tokenizer=str(small_tokenizer_dir),
                                  data=DocumentsConfig(paths=[str(path)]), val_fraction=0.1, shard_tokens=5000))
        out.append(str(root / name))
    return out


def loader(paths, weights=None, seq_len=32, batch=4, **kw):
    weights = weights or [1.0] * len(paths)
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in ("bos_aligned", "shuffle", "seed")}
    cfg = LoaderConfig(datasets=[DatasetSource(p, w) for p, w in zip(paths, weights)], seq_len=seq_len, **cfg_kw)
    return TokenLoader(cfg, batch, **kw)


def test_contiguous_windows_tile_the_shard_with_one_shared_token():
    starts = window_starts(np.array([0, 10, 100]), 100, seq_len=8, bos_aligned=False)
    assert starts.tolist() == list(range(0, 92, 8))
    assert starts[-1] + 8 + 1 <= 100


def test_bos_aligned_windows_start_at_documents_and_continue_long_ones():
    # documents [0,5) [5,40) [40,43) [43,100), seq_len 8: a window that ends inside a document
    # begun within it restarts at that document; windows inside one long document continue it
    starts = window_starts(np.array([0, 5, 40, 43, 100]), 100, seq_len=8, bos_aligned=True).tolist()
    assert starts == [0, 5, 13, 21, 29, 37, 43, 51, 59, 67, 75, 83, 91]


def test_bos_aligned_windows_drop_no_token():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=300)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    n = int(doc_starts[-1])
    starts = window_starts(doc_starts, n, seq_len=16, bos_aligned=True)
    covered = np.zeros(n, bool)
    for s in starts:
        covered[s : s + 17] = True
    assert covered[: int(starts[-1])].all()
    starts_set = set(doc_starts.tolist())
    for s in starts:  # every window starts at a document or inside a document longer than a window
        if s not in starts_set:
            d = np.searchsorted(doc_starts, s, side="right") - 1
            assert doc_starts[d + 1] - doc_starts[d] > 16


def test_windows_are_inputs_plus_shifted_targets(datasets):
    batch = next(loader(datasets[:1], shuffle=False, bos_aligned=False))
    assert batch.shape == (4, 33) and batch.dtype.is_floating_point is False
    flat = np.concatenate([s.tokens for s in open_shards(datasets[0])])
    assert batch[0].tolist() == flat[:33].tolist()
    assert batch[1, 0].item() == batch[0, 32].item()  # the last target is the next window's first input


def test_bos_aligned_batches_mostly_start_with_bos(datasets):
    batch = next(loader(datasets[1:], batch=64, bos_aligned=True))
    assert (batch[:, 0] == 0).all()  # short documents: every window starts at a BOS


def test_shuffle_is_deterministic_from_the_seed(datasets):
    a = [next(loader(datasets, seed=1)) for _ in range(1)][0]
    b = next(loader(datasets, seed=1))
    c = next(loader(datasets, seed=2))
    assert (a == b).all() and not (a == c).all()


def test_data_parallel_ranks_split_the_global_batch_without_overlap(datasets):
    single = loader(datasets, batch=8)
    ranks = [loader(datasets, batch=4, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        whole = next(single)
        parts = [next(r) for r in ranks]
        assert (whole[:4] == parts[0]).all() and (whole[4:] == parts[1]).all()


def test_resuming_from_state_gives_the_same_batches_as_not_stopping(datasets):
    uninterrupted = loader(datasets, weights=[3, 1], batch=3)
    expected = [next(uninterrupted) for _ in range(40)]
    first = loader(datasets, weights=[3, 1], batch=3)
    got = [next(first) for _ in range(17)]
    state = first.state_dict()
    resumed = loader(datasets, weights=[3, 1], batch=3)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(23)]
    assert all((a == b).all() for a, b in zip(expected, got))


def test_loader_cycles_epochs_with_a_new_order(datasets):
    ld = loader(datasets[:1], batch=1, seq_len=64)
    n = len(ld.datasets[0])
    first = [tuple(next(ld)[0].tolist()) for _ in range(n)]
    second = [tuple(next(ld)[0].tolist()) for _ in range(n)]
    assert len(set(first)) == n and set(first) == set(second) and first != second


def test_mixture_follows_the_weights(datasets):
    ld = loader(datasets, weights=[0.75, 0.25], batch=100)
    for _ in range(40):
        next(ld)
    picks = ld.cursors
    counts = [e * len(d) + p for (e, p), d in zip(picks, ld.datasets)]
    share = counts[0] / sum(counts)
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / 4000) ** 0.5  # within 4 binomial standard errors


def test_evaluation_loader_visits_every_window_once_across_ranks(datasets):
    seen = Counter()
    for r in range(2):
        for batch in loader(datasets[1:], batch=5, rank=r, world_size=2, loop=False, split="val", shuffle=False):
            seen.update(tuple(row) for row in batch.tolist())
    n = len(loader(datasets[1:], split="val").datasets[0])
    assert sum(seen.values()) == n


def test_mismatched_state_is_refused(datasets):
    state = loader(datasets, seq_len=32).state_dict()
    with pytest.raises(InputError, match="seq_len"):
        loader(datasets, seq_len=16).load_state_dict(state)


def test_too_little_data_for_a_window_is_an_error(datasets):
    with pytest.raises(InputError, match="too few for one window"):
        loader(datasets[1:], seq_len=10**6)


def rows_of(ld, n_batches):
    return [tuple(row) for _ in range(n_batches) for row in next(ld).tolist()]


def test_skipped_samples_are_never_served_and_every_other_sample_keeps_its_window(datasets):
    stream = rows_of(loader(datasets, weights=[3, 1], batch=4), 10)
    skipping = loader(datasets, weights=[3, 1], batch=4)
    skipping.skip_samples(6, 15)
    skipping.skip_samples(20, 22)
    assert rows_of(skipping, 6) == (stream[:6] + stream[15:20] + stream[22:])[:24]
    assert skipping.samples == 24 + 11


def test_data_parallel_ranks_skip_the_same_global_samples(datasets):
    single = loader(datasets, batch=8)
    ranks = [loader(datasets, batch=4, rank=r, world_size=2) for r in range(2)]
    for ld in (single, *ranks):
        ld.skip_samples(3, 13)
    for _ in range(4):
        whole = next(single)
        assert (whole[:4] == next(ranks[0])).all() and (whole[4:] == next(ranks[1])).all()


def test_skipped_ranges_are_resumed_from_the_loader_state(datasets):
    uninterrupted = loader(datasets, batch=3)
    uninterrupted.skip_samples(10, 40)
    expected = rows_of(uninterrupted, 20)
    first = loader(datasets, batch=3)
    first.skip_samples(10, 40)
    got = rows_of(first, 2)
    resumed = loader(datasets, batch=3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict()["skipped"] == [[10, 40]]
    assert got + rows_of(resumed, 18) == expected


def test_skipping_past_an_epoch_end_keeps_the_epoch_order(datasets):
    n = len(loader(datasets[:1], seq_len=64).datasets[0])
    stream = rows_of(loader(datasets[:1], batch=1, seq_len=64), 2 * n + 3)
    skipping = loader(datasets[:1], batch=1, seq_len=64)
    skipping.skip_samples(2, n + 5)
    assert rows_of(skipping, n) == (stream[:2] + stream[n + 5:])[:n]


def test_a_state_saved_before_skipping_existed_loads_with_no_skipped_samples(datasets):
    state = loader(datasets).state_dict()
    del state["skipped"]
    ld = loader(datasets)
    ld.load_state_dict(state)
    assert ld.state_dict()["skipped"] == []


def test_an_empty_or_negative_skipped_range_is_refused(datasets):
    with pytest.raises(ValueError, match="start < stop"):
        loader(datasets).skip_samples(5, 5)
