"""``lmforge pretrain`` with the loader's curricula and the re-warm schedule on a tiny model: what
metrics.jsonl logs, a run stopped mid-schedule and resumed equal to an uninterrupted one, and the
bad input refused before anything is written."""

from pathlib import Path

import pytest

from lmforge.cli.main import main
from lmforge.data.documents import DocumentsConfig
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl

DEMO = "recipes/demo/pretrain.yaml"


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_tokenizer_dir, corpus_texts) -> dict[str, Path]:
    """Two datasets whose documents carry a score (``q``: the text's length), and a third, the replay set."""
    root = tmp_path_factory.mktemp("scored")
    half = len(corpus_texts) // 2
    parts = {"A": corpus_texts[:half], "B": corpus_texts[half:],
             "R": [f"Note {i}: " + "la " * (i % 9 + 1) for i in range(300)]}
    out = {}
    for name, texts in parts.items():
        docs = write_jsonl(root / f"{name}.jsonl", [{"id": f"{name}{i}", "text": t, "q": len(t)} for i, t in enumerate(texts)])
        run_prepare(PrepareRecipe(run_dir=str(root / name), tokenizer=str(small_tokenizer_dir), val_fraction=0.1,
                                  data=DocumentsConfig(paths=[str(docs)], score_field="q")))
        out[name] = root / name
    return out


def tiny(run_dir: Path, tokenizer: Path, data: dict[str, Path], **overrides) -> list[str]:
    """The demo recipe for a tiny fp32 model (2 layers of width 32, 8 windows of 32 tokens a step)
    with every curriculum on at once and a re-warm from 1e-3 to 3e-3."""
    keys = {"run_dir": run_dir, "tokenizer": tokenizer,
            "data.datasets": f"[{{path: {data['A']}}}, {{path: {data['B']}}}]", "data.seq_len": 32,
            "data.replay": f"[{{path: {data['R']}, share: 0.25}}]",
            "data.mixture_schedule": "[{step: 2, weights: [1.0, 0.0]}, {step: 8, weights: [0.2, 1.0]}]",
            "data.mixture_interpolation": "linear", "data.seq_len_warmup": "{steps: 6, start: 8}",
            "data.score_order": "ascending",
            "model.vocab_size": 512, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
            "model.ffn_hidden": 64, "model.max_seq_len": 64, "train.max_steps": 10, "train.lr": 3e-3,
            "train.warmup_start": 1e-3, "train.warmup_steps": 3, "train.micro_batch_size": 4,
            "train.batch_tokens": 256, "train.precision": "fp32", "train.compile": False, "train.device": "cpu",
            "train.eval_every": 5, "train.eval_batches": 1, "train.checkpoint_every": 5, "train.tensorboard": False,
            **overrides}
    return [DEMO, *(f"{k}={v}" for k, v in keys.items())]


def steps(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k in ("step", "loss", "lr", "grad_norm", "tokens", "targets")
             or k.startswith(("data/", "val"))} for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def straight(scored, small_tokenizer_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    assert main(["pretrain", *tiny(run_dir, small_tokenizer_dir, scored)]) == 0
    return run_dir


def test_metrics_log_the_shares_drawn_the_row_length_the_score_and_the_rewarmed_rate(straight):
    rows = steps(straight)
    assert len(rows) == 10
    assert rows[0]["lr"] == pytest.approx(1e-3 + 2e-3 / 3) and rows[2]["lr"] == pytest.approx(3e-3)
    # the ramp 8 + 24 s / 6 at steps s = 0..5 is 8, 12, 16, 20, 24, 28: the divisors of 32 below it
    assert [r["data/seq_len"] for r in rows] == [8, 8, 16, 16, 16, 16, 32, 32, 32, 32]
    assert all(r["tokens"] == 256 * r["step"] for r in rows)  # every step the same tokens, whatever its row length
    for r in rows:
        assert sum(r[f"data/drawn/{n}"] for n in "ABR") == pytest.approx(1.0)
        assert r["data/weight/R"] == pytest.approx(0.25)
    # linear from the datasets' own (1, 1) at step 0 to (1, 0) at step 2, then to (0.2, 1) at step 8, times 1 - 0.25
    assert rows[2]["data/weight/B"] == 0.0 and rows[2]["data/drawn/B"] == 0.0
    assert rows[1]["data/weight/B"] == pytest.approx(0.75 * 0.25)
    assert rows[4]["data/weight/B"] == pytest.approx(0.75 * (2 / 6) * (1 / 1.2))
    assert rows[9]["data/weight/B"] > rows[9]["data/weight/A"] > 0
    assert all(r["data/score"] > 0 for r in rows)
    assert {"val/A/loss", "val/B/loss", "val/R/loss"} <= set(rows[-1])  # the replay set is validated: forgetting


def test_a_run_stopped_mid_schedule_and_resumed_equals_the_uninterrupted_run(straight, scored, small_tokenizer_dir,
                                                                              tmp_path):
    args = tiny(tmp_path / "parts", small_tokenizer_dir, scored)
    assert main(["pretrain", *args, "train.stop_at_step=4"]) == 0  # inside the warm-up, the ramp and the re-warm
    assert len(steps(tmp_path / "parts")) == 4
    assert main(["pretrain", *args]) == 0
    def trained(run_dir: Path) -> list[dict]:  # the stopped run also validated at its stop
        return [{k: v for k, v in r.items() if not k.startswith("val")} for r in steps(run_dir)]

    assert trained(tmp_path / "parts") == trained(straight)  # bit-identical: the same batches, token for token
    assert steps(tmp_path / "parts")[-1] == steps(straight)[-1]


@pytest.mark.parametrize("override, message", [
    ("data.mixture_schedule=[{step: 11, weights: [1.0, 1.0]}]", r"data\.mixture_schedule\[0\]\.step = 11 is past"),
    ("data.mixture_schedule=[{step: 0, weights: [0.0, 0.0]}]", r"mixture_schedule\[0\]\.weights"),
    ("data.seq_len_warmup={steps: 20, start: 8}", r"data\.seq_len_warmup\.steps = 20 is past"),
    ("data.replay=[{path: /nonexistent/replay, share: 0.1}]", r"data\.replay\[0\]\.path = /nonexistent/replay"),
])
def test_bad_curricula_are_one_line_exit_2_and_nothing_written(override, message, scored, small_tokenizer_dir,
                                                               tmp_path, capsys):
    run_dir = tmp_path / "bad"
    assert main(["pretrain", *tiny(run_dir, small_tokenizer_dir, scored), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(__import__("re").search(message, line) for line in err[-1:]), err
    assert not run_dir.exists()
