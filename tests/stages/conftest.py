"""Fixtures of the stage tests: a tiny base checkpoint with the shared tokenizer."""

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory, small_tokenizer_dir):
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=128))
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


@pytest.fixture()
def prompts(tmp_path):
    """A prompt file of 12 demo tasks (messages ending with the answer), for the RL stages."""
    from lmforge.data.sft_demo import make_examples
    from tests.conftest import write_jsonl

    return write_jsonl(tmp_path / "prompts.jsonl", make_examples(12, seed=3))
