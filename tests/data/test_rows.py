import pytest
import torch

from lmforge.data.rows import RowLoader


def rows(n=25):
    return {"input_ids": torch.arange(2 * n).view(n, 2)}


def served(ld, n_batches):
    return [tuple(r) for _ in range(n_batches) for r in next(ld)["input_ids"].tolist()]


def test_skipped_rows_are_never_served_and_the_others_keep_their_order_across_epochs():
    stream = served(RowLoader(rows(), 3, seed=1), 30)
    skipping = RowLoader(rows(), 3, seed=1)
    skipping.skip_samples(4, 31)  # into the second epoch
    assert served(skipping, 10) == (stream[:4] + stream[31:])[:30]
    assert skipping.samples == 30 + 27


def test_row_loader_resumes_its_skipped_ranges_exactly():
    full = RowLoader(rows(), 3, seed=1)
    full.skip_samples(7, 12)
    expected = served(full, 12)
    first = RowLoader(rows(), 3, seed=1)
    first.skip_samples(7, 12)
    got = served(first, 2)
    resumed = RowLoader(rows(), 3, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert got + served(resumed, 10) == expected


def test_row_loader_ranks_skip_the_same_global_rows():
    ranks = [RowLoader(rows(), 2, seed=1, rank=r, world_size=2) for r in range(2)]
    whole = RowLoader(rows(), 4, seed=1)
    for ld in (whole, *ranks):
        ld.skip_samples(2, 9)
    for _ in range(5):
        both = torch.cat([next(r)["input_ids"] for r in ranks])
        assert torch.equal(both, next(whole)["input_ids"])


def test_a_row_loader_state_saved_before_skipping_existed_still_loads():
    state = RowLoader(rows(), 3).state_dict()
    del state["skipped"]
    ld = RowLoader(rows(), 3)
    ld.load_state_dict(state)
    assert ld.state_dict()["skipped"] == []


def test_an_evaluation_row_loader_cannot_skip():
    with pytest.raises(ValueError, match="training"):
        RowLoader(rows(), 3, loop=False).skip_samples(0, 2)
