"""pretrain's ``init``: a run starts from another run's weights with its own optimizer, schedule
and data (continued pre-training), may change the context keys (max_seq_len, rope_*) as a
context extension does (recipes/long_context/), and is refused any other change of the model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig
from lmforge.model.rope import rope_tables
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from tests.conftest import REPO, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"model.rope_scaling": "yarn", "model.rope_factor": 2.0, "model.rope_original_max_seq_len": 32}


@pytest.fixture(scope="module")
def shards(tmp_path_factory, small_tokenizer_dir, corpus_texts) -> Path:
    root = tmp_path_factory.mktemp("extend_data")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "shards"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return root / "shards"


@pytest.fixture()
def recipe(tmp_path, shards, small_tokenizer_dir):
    """A tiny fp32 pre-training recipe at sequence 32 (keyword overrides are dotted keys)."""

    def make(run_dir: str, **overrides) -> PretrainRecipe:
        keys = {"run_dir": str(tmp_path / run_dir), "tokenizer": str(small_tokenizer_dir),
                "model.vocab_size": 512, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
                "model.n_kv_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
                "data.datasets": f"[{{path: {shards}}}]", "data.seq_len": 32, "train.max_steps": 4, "train.lr": 3e-3,
                "train.warmup_steps": 1, "train.micro_batch_size": 4, "train.precision": "fp32",
                "train.eval_every": 0, "train.eval_batches": 1, "train.checkpoint_every": 0,
                "train.tensorboard": False, "train.device": "cpu", **overrides}
        return load_config(PretrainRecipe, None, [f"{k}={v}" for k, v in keys.items()])

    return make


def weights(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(path)
    return model.state_dict()


def test_a_run_with_init_starts_from_its_weights_at_a_longer_context_with_yarn(recipe, tmp_path):
    run_pretrain(recipe("base"))
    base = weights(tmp_path / "base")
    # lr 1e-9: one AdamW step moves a weight by about 1e-9, so the run's weights are the base's
    summary = run_pretrain(recipe("long", init=tmp_path / "base", **YARN, **{
        "model.max_seq_len": 64, "data.seq_len": 64, "train.max_steps": 1, "train.warmup_steps": 0, "train.lr": 1e-9}))
    assert summary["step"] == 1 and summary.get("start_step", 0) == 0  # its own schedule, from step 0
    model, _ = load_model(tmp_path / "long")
    assert model.cfg.rope_scaling == "yarn" and model.cfg.max_seq_len == 64
    for name, value in model.state_dict().items():
        if name in base:
            assert torch.allclose(value, base[name], atol=1e-6), name
    cos, _ = rope_tables(model.cfg)
    assert torch.equal(model.rope_cos, cos)  # the tables are YaRN's, not the base's
    # the same run without init starts from the seed's random weights, far from the trained base
    run_pretrain(recipe("scratch", **YARN, **{"model.max_seq_len": 64, "data.seq_len": 64, "train.max_steps": 1,
                                               "train.warmup_steps": 0, "train.lr": 1e-9}))
    scratch = weights(tmp_path / "scratch")
    assert max(float((scratch[k] - base[k]).abs().max()) for k in base) > 1e-3


def test_init_refuses_a_model_that_differs_in_more_than_its_context_keys_and_writes_nothing(recipe, tmp_path):
    run_pretrain(recipe("base"))
    with pytest.raises(InputError, match=r"init: .* was trained with model\.ffn_hidden=64 \(this recipe: 96\).*"
                                         r"only max_seq_len and the rope_\* keys"):
        run_pretrain(recipe("wider", init=tmp_path / "base", **{"model.ffn_hidden": 96}))
    assert not (tmp_path / "wider").exists()
    with pytest.raises(InputError, match="not a checkpoint"):
        run_pretrain(recipe("lost", init=tmp_path / "nowhere"))


def test_a_resumed_run_keeps_its_own_weights_instead_of_loading_init_again(recipe, tmp_path, caplog):
    run_pretrain(recipe("base"))
    run_pretrain(recipe("long", init=tmp_path / "base", **{"train.max_steps": 2, "train.checkpoint_every": 1}))
    with caplog.at_level(logging.INFO, logger="lmforge"):
        summary = run_pretrain(recipe("long", init=tmp_path / "base", **{"train.max_steps": 3,
                                                                          "train.checkpoint_every": 1}))
    assert summary["start_step"] == 2 and summary["step"] == 3
    assert any("not loaded: the run resumes" in r.getMessage() for r in caplog.records)


def test_the_long_context_recipes_extend_the_256_token_model_changing_only_its_context_keys():
    base = load_config(PretrainRecipe, REPO / "recipes/long_context/pretrain.yaml")
    assert base.data.seq_len == base.model.max_seq_len == 256 and base.init is None
    rope = {}
    for name in ("extend_pi", "extend_ntk", "extend_yarn"):
        extend = load_config(PretrainRecipe, REPO / f"recipes/long_context/{name}.yaml")
        assert extend.init == base.run_dir and extend.data.seq_len == extend.model.max_seq_len == 1024
        assert extend.data.datasets == base.data.datasets and extend.tokenizer == base.tokenizer
        changed = {k for k, v in vars(extend.model).items() if vars(base.model)[k] != v}
        assert changed - {"max_seq_len"} and all(k.startswith("rope_") for k in changed - {"max_seq_len"}), changed
        rope[name] = {k: vars(extend.model)[k] for k in changed}
    assert rope["extend_pi"] == {"max_seq_len": 1024, "rope_scaling": "linear", "rope_factor": 4.0}
    assert rope["extend_ntk"] == {"max_seq_len": 1024, "rope_theta": pytest.approx(10000 * 4 ** (64 / 62), rel=1e-6)}
    assert rope["extend_yarn"]["rope_scaling"] == "yarn" and rope["extend_yarn"]["rope_original_max_seq_len"] == 256
    assert base.model.head_dim == 64  # the NTK base above is for this head dimension
