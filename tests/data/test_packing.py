"""Packing SFT examples into rows, the block-causal mask and the padded collate."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.data.packing import (
    IGNORE_INDEX,
    assign_bins,
    block_causal_mask,
    document_ids,
    pack_examples,
    pad_examples,
)

PAD = 2


def make_examples(lengths: list[int], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(5, 60) for _ in range(n)]
        labels = [i if rng.random() < 0.6 else IGNORE_INDEX for i in ids]
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "greedy"])
def test_every_example_lands_in_exactly_one_bin_within_capacity(strategy):
    lengths = [random.Random(1).randrange(1, 17) for _ in range(40)]
    bins = assign_bins(lengths, 16, strategy)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins)


def test_best_fit_decreasing_fills_the_tightest_bin():
    # 6 -> bin0 (4 left); 5 -> bin1 (5 left); 4 fits both, best fit is bin0 (exactly full)
    assert assign_bins([6, 5, 4, 5], 10, "bfd") == [[0, 2], [1, 3]]
    assert assign_bins([3, 3, 3, 3], 6, "greedy") == [[0, 1], [2, 3]]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 24), min_size=1, max_size=30), st.sampled_from(["bfd", "ffd", "greedy"]))
def test_packed_rows_hold_each_example_verbatim_with_restarted_positions(lengths, strategy):
    examples = make_examples(lengths)
    batch = pack_examples(examples, 24, PAD, strategy)
    assert batch["input_ids"].shape[1] == 24
    found = []
    for row in range(batch["input_ids"].shape[0]):
        pos, ids, labels = (batch[k][row].tolist() for k in ("position_ids", "input_ids", "labels"))
        starts = [t for t, p in enumerate(pos) if p == 0] + [24]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))
            assert labels[a] == IGNORE_INDEX  # a document start is never a target
            found.append((tuple(ids[a:b]), tuple(labels[a + 1 : b])))
    expected = [(tuple(ids), tuple(lab[1:])) for ids, lab in examples]
    real = [f for f in found if f in expected]
    assert sorted(real) == sorted(expected)
    # whatever is left is padding
    n_real = sum(lengths)
    assert int((batch["input_ids"] != PAD).sum()) <= n_real <= batch["input_ids"].numel()


def test_packing_is_deterministic():
    examples = make_examples([random.Random(3).randrange(1, 30) for _ in range(50)])
    a, b = pack_examples(examples, 32, PAD), pack_examples(list(examples), 32, PAD)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_padding_is_masked_and_separate_from_documents():
    batch = pack_examples(make_examples([5, 3]), 12, PAD)
    assert batch["input_ids"][0, 8:].tolist() == [PAD] * 4
    assert batch["labels"][0, 8:].tolist() == [IGNORE_INDEX] * 4
    assert document_ids(batch["position_ids"])[0].tolist() == [1] * 5 + [2] * 3 + [3] * 4


def test_example_longer_than_the_row_is_an_error():
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than the row length 8"):
        pack_examples(make_examples([3, 9]), 8, PAD)


def test_block_causal_mask_is_causal_within_documents_only():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(position_ids)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 6)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(block_causal_mask(torch.arange(4)[None])[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_pad_examples_right_pads_with_pad_id_and_ignored_labels():
    examples = make_examples([3, 5])
    batch = pad_examples(examples, PAD, pad_to=6)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0, 3:].tolist() == [PAD] * 3 and batch["labels"][0, 3:].tolist() == [IGNORE_INDEX] * 3
    assert batch["labels"][1, :5].tolist() == examples[1][1]
    assert batch["position_ids"].tolist() == [list(range(6))] * 2
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_examples(examples, PAD, pad_to=4)
