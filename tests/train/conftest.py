from pathlib import Path

import pytest

from lmforge.core.config import load_config
from lmforge.data.documents import DocumentsConfig
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, small_tokenizer_dir, corpus_texts) -> Path:
    from tests.conftest import write_jsonl

    root = tmp_path_factory.mktemp("train_data")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "shards"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return root / "shards"


def tiny_pretrain_overrides(run_dir: Path, shards: Path, tokenizer: Path, **overrides) -> list[str]:
    """A tiny fp32 pre-training recipe as dotted overrides (``overrides`` win): 2 layers, width 32,
    4 heads (2 KV heads), vocabulary 512; 8 windows of 32 tokens per step, 8 steps."""
    base = {
        "run_dir": str(run_dir), "tokenizer": str(tokenizer),
        "model.vocab_size": 512, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 64,
        "data.datasets": f"[{{path: {shards}}}]", "data.seq_len": 32,
        "train.max_steps": 8, "train.lr": 3e-3, "train.warmup_steps": 2, "train.micro_batch_size": 4,
        "train.batch_tokens": 256, "train.precision": "fp32", "train.eval_every": 4, "train.eval_batches": 2,
        "train.checkpoint_every": 4, "train.tensorboard": False, "train.device": "cpu",
    }
    base.update(overrides)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture()
def make_recipe(tmp_path, shards_dir, small_tokenizer_dir):
    """A tiny fp32 pre-training recipe (``tiny_pretrain_overrides``); keyword overrides are dotted keys."""

    def make(run_dir: Path | None = None, **overrides) -> PretrainRecipe:
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(run_dir or tmp_path / "run", shards_dir,
                                                                         small_tokenizer_dir, **overrides))

    return make
