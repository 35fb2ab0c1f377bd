"""The reference model: a frozen copy, the policy with adapters disabled, or the untrained policy itself."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from lmforge.data.preference import pair_rows, parse_pair
from lmforge.model.config import ModelConfig
from lmforge.objectives.reference import frozen_copy_reference, precompute_logprobs, untrained_policy_reference
from tests.model.test_hf import randomized

RECORDS = [{"prompt": "The answer is ", "chosen": "the king", "rejected": "42"},
           {"prompt": "Once upon a time", "chosen": " there was a cat.", "rejected": " no."},
           {"prompt": "Q", "chosen": " yes", "rejected": " no, not at all"}]


@pytest.mark.parametrize("side", ["right", "left"])
def test_untrained_policy_scores_like_a_frozen_copy_without_copying_the_model(small_tokenizer, monkeypatch, side):
    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64)
    model = randomized(cfg).train()
    rows = pair_rows([parse_pair(tok, r, 64, "error")[0] for r in RECORDS], tok.pad_id, side=side)
    device = torch.device("cpu")
    expected = {p: precompute_logprobs(frozen_copy_reference(model), rows, p, 2, device, nullcontext)
                for p in ("chosen_", "rejected_")}

    def no_copy(*args, **kwargs):
        raise AssertionError("precomputing the reference must not copy the model")

    monkeypatch.setattr(copy, "deepcopy", no_copy)
    n_params = len(list(model.parameters()))
    for prefix, logps in expected.items():
        got = precompute_logprobs(untrained_policy_reference(model), rows, prefix, 2, device, nullcontext)
        assert torch.equal(got, logps) and torch.isfinite(got).all() and (got < 0).all()
    assert model.training  # scored in eval mode, then put back
    assert len(list(model.parameters())) == n_params and all(p.grad is None for p in model.parameters())
