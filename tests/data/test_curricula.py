"""The loader's curricula: replay at a share, mixture weights scheduled by step, sequence-length
warm-up and ordering by a document score; each against its closed form and resumed exactly
mid-schedule; and their bad input."""

import json

import numpy as np
import pytest

from lmforge.core.config import ConfigError, from_dict
from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig
from lmforge.data.loader import (
    DatasetSource,
    LoaderConfig,
    MixturePoint,
    ReplaySource,
    SeqLenWarmup,
    TokenLoader,
    check_curriculum,
    cut_windows,
    mixture_weights,
    piece_length,
)
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_tokenizer_dir, corpus_texts):
    """Three prepared datasets: the corpus with a score per document (its length, so the order is
    known), short notes, and the notes again as a third dataset (a replay set)."""
    root = tmp_path_factory.mktemp("curricula")
    a = write_jsonl(root / "a.jsonl", [{"id": f"a{i}", "text": t, "metadata": json.dumps({"q": len(t) % 97})}
                                       for i, t in enumerate(corpus_texts)])
    b = write_jsonl(root / "b.jsonl", [{"id": f"b{i}", "text": f"Note {i}: " + "la " * (i % 5 + 1)} for i in range(400)])
    c = write_jsonl(root / "c.jsonl", [{"id": f"c{i}", "text": f"Other {i}: " + "do " * (i % 7 + 1)} for i in range(300)])
    for name, path, score in (("A", a, "metadata.q"), ("B", b, None), ("C", c, None)):
        run_prepare(PrepareRecipe(run_dir=str(root / name), tokenizer=str(small_tokenizer_dir), shard_tokens=4000,
                                  data=DocumentsConfig(paths=[str(path)], score_field=score), val_fraction=0.1))
    return {name: str(root / name) for name in "ABC"}


def config(prepared, names="AB", **kw) -> LoaderConfig:
    return LoaderConfig(datasets=[DatasetSource(prepared[n]) for n in names], seq_len=32, **kw)


def batches(cfg: LoaderConfig, n: int, batch=4, **kw) -> list[np.ndarray]:
    loader = TokenLoader(cfg, batch, **kw)
    return [next(loader).numpy() for _ in range(n)]


def resumed(cfg: LoaderConfig, n: int, stop: int, batch=4, **kw) -> list[np.ndarray]:
    """``n`` batches from a loader stopped after ``stop`` and rebuilt from its state."""
    first = TokenLoader(cfg, batch, **kw)
    out = [next(first).numpy() for _ in range(stop)]
    second = TokenLoader(cfg, batch, **kw)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through JSON, as the checkpoint holds it
    return out + [next(second).numpy() for _ in range(n - stop)]


def equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b))


# -- the closed forms


def test_replay_sets_draw_their_share_and_the_datasets_share_the_rest_by_weight(prepared):
    cfg = LoaderConfig(datasets=[DatasetSource(prepared["A"], 3.0), DatasetSource(prepared["B"], 1.0)],
                       replay=[ReplaySource(prepared["C"], share=0.2)], seq_len=32)
    assert mixture_weights(cfg, np.array([0, 50])) == pytest.approx(np.array([[0.6, 0.2, 0.2]] * 2), abs=1e-15)
    loader = TokenLoader(cfg, 100)
    chosen = np.bincount(loader._choices(0, 20000), minlength=3) / 20000
    # binomial standard error of a share p over 20000 draws is at most 0.0036: 5 of them
    assert np.abs(chosen - [0.6, 0.2, 0.2]).max() < 0.018
    next(loader)
    metrics = loader.pop_metrics()
    assert metrics["data/weight/C"] == pytest.approx(0.2)
    assert sum(metrics[f"data/drawn/{n}"] for n in "ABC") == pytest.approx(1.0)


def test_piecewise_and_linear_mixture_weights_at_several_steps():
    points = [MixturePoint(10, [1.0, 3.0]), MixturePoint(30, [2.0, 0.0])]
    cfg = LoaderConfig(datasets=[DatasetSource("a", 1.0), DatasetSource("b", 1.0)], mixture_schedule=points)
    steps = np.array([0, 9, 10, 20, 29, 30, 99])
    assert mixture_weights(cfg, steps)[:, 0].tolist() == [0.5, 0.5, 0.25, 0.25, 0.25, 1.0, 1.0]
    linear = LoaderConfig(datasets=cfg.datasets, mixture_schedule=points, mixture_interpolation="linear")
    # from (0.5 at step 0) to (0.25 at 10), to (1.0 at 30), then held
    expected = [0.5, 0.5 - 0.25 * 9 / 10, 0.25, 0.25 + 0.75 * 10 / 20, 0.25 + 0.75 * 19 / 20, 1.0, 1.0]
    assert mixture_weights(linear, steps)[:, 0] == pytest.approx(expected, abs=1e-15)
    with_replay = LoaderConfig(datasets=cfg.datasets, mixture_schedule=points, replay=[ReplaySource("c", 0.5)])
    assert mixture_weights(with_replay, np.array([0, 30])) == pytest.approx(np.array([[0.25, 0.25, 0.5],
                                                                                      [0.5, 0.0, 0.5]]), abs=1e-15)


def test_a_one_hot_schedule_switches_dataset_at_its_step(prepared):
    cfg = config(prepared, mixture_schedule=[MixturePoint(0, [1.0, 0.0]), MixturePoint(3, [0.0, 1.0])])
    loader = TokenLoader(cfg, 4, samples_per_step=8)  # two batches a step
    for step in range(6):
        for _ in range(2):
            next(loader)
        assert loader.pop_metrics()["data/drawn/A"] == (1.0 if step < 3 else 0.0)


def test_sequence_length_warmup_grows_over_divisors_of_seq_len():
    warm = SeqLenWarmup(steps=8, start=4)
    # the ramp 4 + 28 * s / 8: 4, 7.5, 11, 14.5, 18, 21.5, 25, 28.5; the largest divisor of 32 below it
    assert [piece_length(warm, 32, s) for s in range(10)] == [4, 4, 8, 8, 16, 16, 16, 16, 32, 32]


def test_cut_windows_keep_every_token_and_every_target_once():
    rows = np.arange(2 * 33).reshape(2, 33)
    pieces = cut_windows(rows, 8)
    assert pieces.shape == (8, 9)
    for r in range(2):  # the pieces' inputs, then the last target, are the window
        mine = pieces[4 * r : 4 * r + 4]
        assert np.concatenate([mine[:, :-1].ravel(), mine[-1:, -1]]).tolist() == rows[r].tolist()
        assert np.concatenate([p[1:] for p in mine]).tolist() == rows[r, 1:].tolist()


def test_warmup_batches_are_the_plain_batches_cut_into_shorter_rows(prepared):
    plain = batches(config(prepared), 6)
    warm = batches(config(prepared, seq_len_warmup=SeqLenWarmup(steps=4, start=8)), 6)
    assert [w.shape for w in warm] == [(16, 9), (16, 9), (8, 17), (8, 17), (4, 33), (4, 33)]
    for p, w in zip(plain, warm):
        assert (cut_windows(p, w.shape[1] - 1) == w).all()


def test_score_order_serves_windows_from_low_to_high_score_and_back(prepared):
    for direction, sign in (("ascending", 1), ("descending", -1)):
        loader = TokenLoader(config(prepared, "A", score_order=direction), 8)
        n = len(loader.datasets[0])
        scores = []
        for _ in range(n // 8):
            next(loader)
            scores.append(loader.pop_metrics()["data/score"])
        assert (sign * np.diff(scores) >= 0).all() and scores[0] != scores[-1]
        assert sorted(loader._permutation(0, 0).tolist()) == list(range(n))  # every window once an epoch


# -- exact resume mid-schedule, token for token


@pytest.mark.parametrize("keys", [
    {"mixture_schedule": [MixturePoint(2, [1.0, 0.2]), MixturePoint(9, [0.1, 1.0])], "mixture_interpolation": "linear"},
    {"mixture_schedule": [MixturePoint(0, [1.0, 0.0]), MixturePoint(5, [0.0, 1.0])]},
    {"seq_len_warmup": SeqLenWarmup(steps=10, start=4)},
    {"score_order": "descending"},
    {"replay": [ReplaySource("C", share=0.3)]},
], ids=["linear", "piecewise", "seq_len_warmup", "score_order", "replay"])
def test_a_loader_resumed_mid_schedule_serves_the_batches_of_an_uninterrupted_one(prepared, keys):
    keys = {k: ([ReplaySource(prepared["C"], r.share) for r in v] if k == "replay" else v) for k, v in keys.items()}
    names = "A" if "score_order" in keys else "AB"
    cfg = config(prepared, names, **keys)
    for rank in (0, 1):  # each data-parallel rank
        straight = batches(cfg, 12, rank=rank, world_size=2, samples_per_step=16)
        assert equal(resumed(cfg, 12, 5, rank=rank, world_size=2, samples_per_step=16), straight)
    assert not equal(straight, batches(config(prepared, names), 12, rank=1, world_size=2))  # the curriculum acts


# -- bad input


def test_mixture_weights_that_do_not_sum_to_a_positive_number_name_the_key(prepared):
    data = {"datasets": [{"path": prepared["A"]}, {"path": prepared["B"]}],
            "mixture_schedule": [{"step": 0, "weights": [0.0, 0.0]}]}
    with pytest.raises(ConfigError, match=r"mixture_schedule\[0\]\.weights"):
        from_dict(LoaderConfig, data, prefix="data.")
    data["mixture_schedule"] = [{"step": 0, "weights": [1.0, -1.0]}]
    with pytest.raises(ConfigError, match=r"data\.mixture_schedule\[0\]\.weights"):
        from_dict(LoaderConfig, data, prefix="data.")
    data["mixture_schedule"] = [{"step": 0, "weights": [1.0]}]
    with pytest.raises(ConfigError, match="one weight per dataset"):
        from_dict(LoaderConfig, data, prefix="data.")


def test_a_schedule_step_past_max_steps_names_the_key(prepared):
    cfg = config(prepared, mixture_schedule=[MixturePoint(0, [1.0, 1.0]), MixturePoint(101, [1.0, 0.0])])
    with pytest.raises(ConfigError, match=r"data\.mixture_schedule\[1\]\.step = 101 is past train\.max_steps = 100"):
        check_curriculum(cfg, 100)
    with pytest.raises(ConfigError, match=r"data\.seq_len_warmup\.steps = 200"):
        check_curriculum(config(prepared, seq_len_warmup=SeqLenWarmup(steps=200, start=8)), 100)
    with pytest.raises(ConfigError, match="divide"):
        from_dict(LoaderConfig, {"seq_len": 32, "seq_len_warmup": {"steps": 4, "start": 5}}, prefix="data.")


def test_a_replay_path_that_does_not_exist_names_the_key(prepared, tmp_path):
    cfg = config(prepared, replay=[ReplaySource(str(tmp_path / "gone"), 0.1)])
    with pytest.raises(InputError, match=r"data\.replay\[0\]\.path = .*gone: no prepared dataset"):
        check_curriculum(cfg, 100)
    with pytest.raises(ConfigError, match="replay shares sum to 1"):
        from_dict(LoaderConfig, {"replay": [{"path": "x", "share": 0.5}, {"path": "y", "share": 0.5}]}, prefix="data.")


def test_ordering_a_dataset_prepared_without_scores_names_its_manifest(prepared):
    with pytest.raises(InputError, match=r"B/manifest\.json: its documents have no scores.*data\.score_field"):
        TokenLoader(config(prepared, score_order="ascending"), 4)


def test_a_document_without_the_score_field_names_the_file_and_line_and_writes_nothing(small_tokenizer_dir, tmp_path):
    docs = write_jsonl(tmp_path / "d.jsonl", [{"text": "one", "q": 1}, {"text": "two"}])
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"d\.jsonl:2: no score 'q' \(data\.score_field\)"):
        run_prepare(PrepareRecipe(run_dir=str(out), tokenizer=str(small_tokenizer_dir),
                                  data=DocumentsConfig(paths=[str(docs)], score_field="q")))
    assert not out.exists() or not any(out.iterdir())


def test_a_noised_loader_logs_what_its_loader_drew(prepared):
    from lmforge.data.noising import NoisedLoader

    inner = TokenLoader(config(prepared, replay=[ReplaySource(prepared["C"], share=0.3)]), 4)
    next(inner)
    metrics = NoisedLoader(inner, noise=None).pop_metrics()  # the objective's corruption draws nothing itself
    assert metrics["data/weight/C"] == pytest.approx(0.3) and sum(metrics[f"data/drawn/{n}"] for n in "ABC") == 1
