"""The SFT objective: packed loss and logits equal those of the examples run one by one."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.data.packing import IGNORE_INDEX, block_causal_mask, pack_examples, pad_examples
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import causal_lm_loss
from lmforge.objectives.sft import SFTObjective

PAD = 2
LENGTHS = [7, 3, 12, 5, 9, 2, 11, 4]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
    return Transformer(cfg).float().eval()


@pytest.fixture(scope="module")
def examples() -> list[tuple[list[int], list[int]]]:
    rng = random.Random(0)
    out = []
    for n in LENGTHS:
        ids = [rng.randrange(5, 64) for _ in range(n)]
        prompt = rng.randrange(0, n)  # the first `prompt` tokens are masked
        out.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def unpacked(model, ids: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits, summed loss and target count of one example run alone."""
    x, y = torch.tensor([ids]), torch.tensor([labels])
    logits = model(x)
    return logits[0], causal_lm_loss(logits[:, :-1], y[:, 1:]), int((y[:, 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def test_packed_loss_equals_token_weighted_unpacked_loss(model, examples):
    batch = pack_examples(examples, 20, PAD)
    assert batch["input_ids"].shape[0] < len(examples)  # several documents share rows
    out = SFTObjective()(model, batch)
    runs = [unpacked(model, ids, lab) for ids, lab in examples]
    assert out.n_targets == SFTObjective().num_targets(batch) == sum(n for _, _, n in runs)
    torch.testing.assert_close(out.loss_sum, sum(loss for _, loss, _ in runs), atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_each_packed_document_has_its_unpacked_logits(model, examples):
    batch = pack_examples(examples, 20, PAD)
    logits = model(batch["input_ids"], positions=batch["position_ids"],
                   attn_mask=block_causal_mask(batch["position_ids"]))
    matched = 0
    for row in range(logits.shape[0]):
        pos = batch["position_ids"][row].tolist()
        starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            ids = batch["input_ids"][row, a:b].tolist()
            if ids in [e for e, _ in examples]:  # not the padding
                torch.testing.assert_close(logits[row, a:b], unpacked(model, ids, ids)[0], atol=1e-5, rtol=0)
                matched += 1
    assert matched == len(examples)


@torch.no_grad()
def test_packed_batch_without_mask_gets_the_block_causal_mask(model, examples):
    batch = pack_examples(examples, 20, PAD)
    explicit = SFTObjective()(model, {**batch, "attn_mask": block_causal_mask(batch["position_ids"])})
    implicit = SFTObjective()(model, batch)
    leaky = SFTObjective()(model, {**batch, "attn_mask": torch.ones(20, 20, dtype=torch.bool).tril()[None, None]})
    torch.testing.assert_close(implicit.loss_sum, explicit.loss_sum)
    assert not torch.allclose(leaky.loss_sum, explicit.loss_sum)  # documents attending across would change it


@torch.no_grad()
def test_padded_batch_loss_equals_unpacked_loss(model, examples):
    out = SFTObjective()(model, pad_examples(examples, PAD))
    runs = [unpacked(model, ids, lab) for ids, lab in examples]
    assert out.n_targets == sum(n for _, _, n in runs)
    torch.testing.assert_close(out.loss_sum, sum(loss for _, loss, _ in runs), atol=1e-4, rtol=1e-5)


def test_loss_has_gradients_and_fully_masked_examples_count_nothing(model):
    batch = pack_examples([([5, 6, 7], [IGNORE_INDEX] * 3), ([8, 9, 10, 11], [8, 9, 10, 11])], 8, PAD)
    out = SFTObjective()(model, batch)
    assert out.n_targets == 3  # 9, 10, 11; the start 8 is masked
    out.loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
