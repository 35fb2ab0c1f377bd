"""Fixtures of the feedback tests: a tiny judge checkpoint whose answers lean to the tokens "A"
and "B" (so its soft labels come from log-probs), and a prompt file of demo tasks."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.sft_demo import make_examples
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.checkpoint import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from tests.conftest import write_jsonl


@pytest.fixture(scope="session")
def judge_checkpoint(tmp_path_factory, small_tokenizer_dir):
    """A random tiny model (context 1024, for the judge's long prompts) with its head rescaled:
    every row small except those of "A" and "B", which share a large direction plus their own
    part. Where that direction meets the hidden state positively both options lead the next
    token and their ratio varies with the prompt; elsewhere neither is among the top 20."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=1024, tie_embeddings=False))
    tok = Tokenizer.load(small_tokenizer_dir)
    a, b = tok.token_to_id("A"), tok.token_to_id("B")
    with torch.no_grad():
        shared = torch.randn(32) * 2.0
        model.lm_head.weight.mul_(0.05)
        model.lm_head.weight[a] = shared + torch.randn(32)
        model.lm_head.weight[b] = shared + torch.randn(32)
    path = tmp_path_factory.mktemp("judge")
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


@pytest.fixture()
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", make_examples(6, seed=2))
