"""``lmforge sft`` with ``data.replay``: pre-training windows among the chat rows at their share,
trained on every token, logged per step, resumed exactly; and a replay set that is not there."""

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli.main import main
from lmforge.core.config import ConfigError, load_config
from lmforge.data.documents import DocumentsConfig
from lmforge.data.loader import ReplaySource
from lmforge.data.replay import replay_rows
from lmforge.data.sft_demo import write_demo
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory, small_tokenizer_dir, corpus_texts) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft_replay")
    write_demo(root / "sft", 60, seed=0, val_fraction=0.1)
    docs = write_jsonl(root / "prose.jsonl", [{"id": f"p{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "prose"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return {"sft": root / "sft", "prose": root / "prose"}


def overrides(run_dir: Path, base: Path, data: dict[str, Path], *more: str) -> list[str]:
    return [f"run_dir={run_dir}", f"checkpoint={base}", f"data.train=[{data['sft'] / 'train.jsonl'}]",
            "data.max_length=128", f"data.replay=[{{path: {data['prose']}, share: 0.25}}]", "train.max_steps=6",
            "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4", "train.precision=fp32",
            "train.eval_every=0", "train.checkpoint_every=3", "train.tensorboard=false", "train.device=cpu", *more]


def trained(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["targets"], r["data/drawn/prose"]) for r in read_metrics(run_dir)
            if "loss" in r]


def test_replay_rows_are_windows_of_max_length_trained_on_every_token_at_their_share(data):
    rows = {"input_ids": torch.ones(30, 96, dtype=torch.long), "labels": torch.full((30, 96), -100),
            "position_ids": torch.arange(96).expand(30, 96).clone()}
    mixed, groups = replay_rows(rows, [ReplaySource(str(data["prose"]), 0.25)], seed=0)
    assert len(mixed["input_ids"]) == 30 + 10 and groups.names == ["sft", "prose"]  # 30 * 0.25 / 0.75
    assert groups.of_row.tolist() == [0] * 30 + [1] * 10
    replay = {k: v[30:] for k, v in mixed.items()}
    assert torch.equal(replay["labels"], replay["input_ids"]) and (replay["position_ids"][:, -1] == 95).all()
    assert len({tuple(r.tolist()) for r in replay["input_ids"]}) == 10  # ten distinct windows of the prose


def test_sft_with_replay_logs_the_share_drawn_and_resumes_exactly(tmp_path, base_checkpoint, data):
    straight = run_sft(load_config(SFTRecipe, None, overrides(tmp_path / "straight", base_checkpoint, data)))
    rows = trained(tmp_path / "straight")
    assert len(rows) == 6 and straight["step"] == 6
    drawn = np.array([r[4] for r in rows])
    assert (0 <= drawn).all() and (drawn <= 1).all() and drawn.mean() > 0  # some steps drew pre-training rows
    run_sft(load_config(SFTRecipe, None, overrides(tmp_path / "parts", base_checkpoint, data, "train.stop_at_step=3")))
    run_sft(load_config(SFTRecipe, None, overrides(tmp_path / "parts", base_checkpoint, data)))
    assert trained(tmp_path / "parts") == rows  # bit for bit: the same rows, replay and chat, step by step


def test_a_replay_set_that_is_not_there_is_one_line_exit_2_and_nothing_written(tmp_path, base_checkpoint, data,
                                                                              capsys):
    gone = {**data, "prose": tmp_path / "gone"}
    args = overrides(tmp_path / "bad", base_checkpoint, gone)
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("train:\n  max_steps: 6\n")
    assert main(["sft", str(recipe), *args]) == 2
    assert "data.replay[0].path = " in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="replay shares sum to 1"):
        load_config(SFTRecipe, None, [f"data.replay=[{{path: {data['prose']}, share: 0.6}}, "
                                      f"{{path: {data['prose']}, share: 0.4}}]"])
