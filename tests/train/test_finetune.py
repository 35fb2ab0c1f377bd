"""What the fine-tuning stages share around the loop: how an optimizer step is sized and how
validation rows are read."""

from __future__ import annotations

import logging

import pytest
import torch

from lmforge.core.run import log
from lmforge.train.finetune import row_accumulation_steps, validation_batches
from lmforge.train.loop import TrainConfig


@pytest.mark.parametrize(("batch_tokens", "rows_per_example", "steps"), [
    (None, 1, 1),  # no target: one micro-batch a step
    (1024, 1, 4),  # 1024 tokens / (4 rows x 64 tokens)
    (1024, 2, 2),  # a pair is two rows of max_length
    (256, 1, 1),
    (128, 1, 1),  # a target below one micro-batch still takes one
])
def test_batch_tokens_count_each_example_as_rows_of_max_length(batch_tokens, rows_per_example, steps):
    cfg = TrainConfig(micro_batch_size=4, batch_tokens=batch_tokens)
    assert row_accumulation_steps(cfg, max_length=64, rows_per_example=rows_per_example) == steps


def test_a_target_between_whole_micro_batches_is_rounded_to_the_nearest_and_logged(caplog):
    cfg = TrainConfig(micro_batch_size=4, batch_tokens=1400)  # 5.47 micro-batches of 4 x 64 tokens
    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.INFO, logger="lmforge"):
            assert row_accumulation_steps(cfg, max_length=64) == 5
    finally:
        log.removeHandler(caplog.handler)
    assert any("batch_tokens 1400 is not a multiple of 256" in r.getMessage() and "using 1280" in r.getMessage()
               for r in caplog.records)


def test_validation_batches_read_every_row_once_in_order_from_the_first_each_time():
    rows = {"input_ids": torch.arange(10).view(5, 2), "labels": torch.arange(10).view(5, 2)}
    batches = validation_batches(rows, 2)
    first, second = [b["input_ids"] for b in batches()], [b["input_ids"] for b in batches()]
    assert [len(b) for b in first] == [2, 2, 1]
    assert torch.equal(torch.cat(first), rows["input_ids"]) and torch.equal(torch.cat(second), rows["input_ids"])
    assert validation_batches(None, 2) is None
