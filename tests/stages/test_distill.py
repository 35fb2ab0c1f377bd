"""Distillation in the stages: `distill:` in sft (α = 0 trains as plain SFT; a teacher pulls the student towards
it, and its stored top k of the whole vocabulary trains as the live teacher; the pre-trained model as teacher
keeps more of pre-training than naive SFT, on the SFT tokens and on replayed pre-training windows, resumed
exactly) and in pretrain (a live teacher and a stored top k, each resumed exactly mid-run, the top-k file read
back rather than recomputed), `lmforge distill` (on-policy: the reverse KL to the teacher falls; exact resume),
the example recipes loading, and bad teachers refused in one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.sft_demo import write_demo
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.objectives.distill_teacher import TOPK_FILE
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.distill import DistillRecipe, run_distill
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

WIDER = {"model.d_model": 48, "model.ffn_hidden": 96, "model.max_seq_len": 128}  # the teacher: wider than the student


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, shards_dir, small_tokenizer_dir):  # noqa: F811
    """A model of width 48 pre-trained 60 steps on the shards (the students are width 32): its checkpoint directory."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    run_pretrain(load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        run, shards_dir, small_tokenizer_dir, **WIDER, **{"train.max_steps": 60, "train.checkpoint_every": 60,
                                                          "train.eval_every": 0, "train.warmup_steps": 4})))
    return load_model(run)[1]


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data")
    write_demo(path, 120, seed=0, val_fraction=0.1)
    return path


def sft_recipe(tmp_path, name, base, data, *overrides) -> SFTRecipe:
    return load_config(SFTRecipe, None, [
        f"run_dir={tmp_path / name}", f"checkpoint={base}", f"data.train=[{data / 'train.jsonl'}]",
        "data.max_length=128", "train.max_steps=8", "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4",
        "train.batch_tokens=512", "train.precision=fp32", "train.eval_every=0", "train.tensorboard=false",
        "train.device=cpu", *overrides])


def steps(run_dir, *keys):
    return [tuple(r[k] for k in keys) for r in read_metrics(run_dir) if "loss" in r]


def test_sft_with_alpha_zero_trains_as_plain_sft_and_a_teacher_pulls_the_student_towards_it(
        tmp_path, base_checkpoint, teacher, sft_data):
    run_sft(sft_recipe(tmp_path, "plain", base_checkpoint, sft_data))
    run_sft(sft_recipe(tmp_path, "zero", base_checkpoint, sft_data, f"distill={{teacher: {teacher}, alpha: 0}}"))
    run_sft(sft_recipe(tmp_path, "kd", base_checkpoint, sft_data,
                       f"distill={{teacher: {teacher}, alpha: 0.5, temperature: 2}}"))
    run_sft(sft_recipe(tmp_path, "topk", base_checkpoint, sft_data,  # k = the vocabulary: the full KL, stored
                       f"distill={{teacher: {teacher}, alpha: 0.5, temperature: 2, top_k: 512}}"))
    plain, zero = steps(tmp_path / "plain", "loss"), steps(tmp_path / "zero", "loss", "distill/data_loss")
    # α = 0: the loss is the data loss, computed from the logits of the target positions alone (the same
    # arithmetic per position as SFT's full logits, up to float32 rounding of the head's matmul)
    assert len(plain) == len(zero) == 8
    for (p,), (z, data) in zip(plain, zero):
        assert z == pytest.approx(p, rel=1e-4) and data == pytest.approx(z, rel=1e-6)
    kd = steps(tmp_path / "kd", "loss", "distill/kd", "distill/data_loss")
    assert all(loss == pytest.approx(0.5 * k + 0.5 * d, rel=1e-5) for loss, k, d in kd)
    assert kd[-1][1] < 0.8 * kd[0][1], kd  # τ²·KL(teacher ‖ student) falls
    stored = steps(tmp_path / "topk", "loss", "distill/kd", "distill/data_loss")
    assert (tmp_path / "topk" / TOPK_FILE).is_file()
    # the teacher's logits stored in float32 from its full forward, against the live ones at the target positions:
    # the same values up to the rounding of the head's matmul, which 8 steps of training carry into the weights
    for a, b in zip(stored, kd):
        assert a == pytest.approx(b, rel=1e-4)


def pretraining_loss(checkpoint, shards) -> float:  # noqa: F811
    model, _ = load_model(checkpoint)
    loader = TokenLoader(LoaderConfig(datasets=[DatasetSource(str(shards))], seq_len=32, shuffle=False), 16,
                         split="val", loop=False)
    batch = next(loader)
    with torch.no_grad():
        return float(CausalLMObjective()(model, batch).loss_sum) / CausalLMObjective().num_targets(batch)


def test_the_pretrained_model_as_its_own_teacher_keeps_more_of_pretraining_than_naive_sft(
        tmp_path, teacher, shards_dir, sft_data):  # noqa: F811
    naive = run_sft(sft_recipe(tmp_path, "naive", teacher, sft_data))
    kept = run_sft(sft_recipe(tmp_path, "self", teacher, sft_data, f"distill={{teacher: {teacher}, alpha: 0.9}}"))
    before = pretraining_loss(teacher, shards_dir)
    after_naive = pretraining_loss(naive["final_checkpoint"], shards_dir)
    after_self = pretraining_loss(kept["final_checkpoint"], shards_dir)
    assert after_naive - before > 0.05, (before, after_naive)
    assert after_self - before < 0.5 * (after_naive - before), (before, after_naive, after_self)
    rows = steps(tmp_path / "self", "distill/kd", "distill/data_loss")
    assert rows[0][0] == pytest.approx(0.0, abs=1e-6)  # the student starts as its teacher
    assert rows[-1][1] < rows[0][1] - 0.1  # while the SFT loss still falls


def test_self_distillation_on_replayed_pretraining_windows_keeps_pretraining_and_resumes_exactly(
        tmp_path, teacher, shards_dir, sft_data):  # noqa: F811
    replay = f"replay: [{shards_dir}], replay_windows: 4, replay_seq_len: 32"
    naive = run_sft(sft_recipe(tmp_path, "naive", teacher, sft_data))
    kept = run_sft(sft_recipe(tmp_path, "replay", teacher, sft_data, f"distill={{teacher: {teacher}, alpha: 0, {replay}}}",
                              "train.checkpoint_every=4"))
    before = pretraining_loss(teacher, shards_dir)
    after_naive = pretraining_loss(naive["final_checkpoint"], shards_dir)
    after_replay = pretraining_loss(kept["final_checkpoint"], shards_dir)
    assert after_naive - before > 0.05, (before, after_naive)
    assert after_replay - before < 0.5 * (after_naive - before), (before, after_naive, after_replay)
    keys = ("step", "loss", "distill/replay_kd", "distill/data_loss")
    rows = steps(tmp_path / "replay", *keys)
    assert rows[0][2] == pytest.approx(0.0, abs=1e-6) and rows[-1][2] > 0  # the student starts as its teacher
    assert all(loss == pytest.approx(data + kd, rel=1e-5) for _, loss, kd, data in rows)  # α = 0, w = 1
    run_sft(sft_recipe(tmp_path, "resumed", teacher, sft_data, f"distill={{teacher: {teacher}, alpha: 0, {replay}}}",
                       "train.checkpoint_every=4", "train.stop_at_step=4"))
    run_sft(sft_recipe(tmp_path, "resumed", teacher, sft_data, f"distill={{teacher: {teacher}, alpha: 0, {replay}}}",
                       "train.checkpoint_every=4"))
    assert steps(tmp_path / "resumed", *keys) == rows  # the replayed windows resume where they stopped


@pytest.mark.parametrize("top_k", [0, 16])
def test_pretraining_with_a_teacher_resumes_exactly_mid_run(tmp_path, teacher, shards_dir, small_tokenizer_dir,  # noqa: F811
                                                            top_k):
    def recipe(name: str, **overrides) -> PretrainRecipe:
        keys = {"distill": f"{{teacher: {teacher}, top_k: {top_k}, temperature: 2}}", "train.eval_every": 4,
                "train.checkpoint_every": 4, **overrides}
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(tmp_path / name, shards_dir,
                                                                         small_tokenizer_dir, **keys))

    run_pretrain(recipe("whole"))
    run_pretrain(recipe("resumed", **{"train.stop_at_step": 4}))
    if top_k:
        stored = (tmp_path / "resumed" / TOPK_FILE).stat().st_mtime_ns
    run_pretrain(recipe("resumed"))
    keys = ("step", "loss", "distill/kd", "distill/data_loss")
    whole, resumed = steps(tmp_path / "whole", *keys), steps(tmp_path / "resumed", *keys)
    assert [s[0] for s in whole] == list(range(1, 9)) and whole[-1][2] < whole[0][2]
    assert resumed == whole  # bit for bit: the teacher (or its stored top k) holds no state
    val = [r["val_loss"] for r in read_metrics(tmp_path / "whole") if "val_loss" in r]
    assert len(val) == 2  # validation scores the data loss alone
    if top_k:
        assert (tmp_path / "resumed" / TOPK_FILE).stat().st_mtime_ns == stored  # read back, not recomputed


def test_on_policy_distillation_lowers_the_reverse_kl_to_the_teacher(tmp_path, base_checkpoint, teacher, prompts):
    summary = run_distill(load_config(DistillRecipe, None, [
        f"run_dir={tmp_path / 'gkd'}", f"checkpoint={base_checkpoint}", f"teacher={teacher}",
        f"data.train=[{prompts}]", "data.max_length=96", "rollout.n=2", "rollout.max_new_tokens=12",
        "gkd.prompts_per_step=4", "train.max_steps=16", "train.lr=1e-2", "train.micro_batch_size=8",
        "train.precision=fp32", "train.device=cpu", "train.tensorboard=false"]))
    rows = [r for r in read_metrics(tmp_path / "gkd") if "reverse_kl" in r]
    assert len(rows) == 16 and summary["step"] == 16
    first = sum(r["reverse_kl"] for r in rows[:4]) / 4
    last = sum(r["reverse_kl"] for r in rows[-4:]) / 4
    assert last < 0.5 * first, (first, last)
    assert all(r["loss"] == pytest.approx(r["reverse_kl"], rel=1e-5) for r in rows)  # β = 1: the loss is the reverse KL
    assert (tmp_path / "gkd" / "final" / "model.safetensors").is_file()
    from lmforge.stages.distill import report

    lines = report(json.loads((tmp_path / "gkd" / "summary.json").read_text()), tmp_path / "gkd", tmp_path / "p.png")
    assert f"{rows[0]['reverse_kl']:.4f} at the first step, {rows[-1]['reverse_kl']:.4f} at the last" in lines[2]


def test_on_policy_distillation_resumes_exactly_mid_run(tmp_path, base_checkpoint, teacher, prompts):
    def recipe(name: str, *overrides: str) -> DistillRecipe:
        return load_config(DistillRecipe, None, [
            f"run_dir={tmp_path / name}", f"checkpoint={base_checkpoint}", f"teacher={teacher}",
            f"data.train=[{prompts}]", "data.max_length=96", "rollout.max_new_tokens=8", "gkd.prompts_per_step=4",
            "gkd.updates_per_batch=2", "train.max_steps=6", "train.checkpoint_every=3", "train.lr=1e-2",
            "train.micro_batch_size=2", "train.precision=fp32", "train.device=cpu", "train.tensorboard=false",
            *overrides])

    run_distill(recipe("whole"))
    run_distill(recipe("resumed", "train.stop_at_step=3"))  # inside a rollout batch served twice (μ = 2)
    run_distill(recipe("resumed"))
    keys = ("step", "loss", "reverse_kl", "teacher_logprob", "response_length_mean")
    whole, resumed = steps(tmp_path / "whole", *keys), steps(tmp_path / "resumed", *keys)
    assert [s[0] for s in whole] == list(range(1, 7))
    assert resumed == whole  # the same samples and the same updates, bit for bit


def test_distill_is_a_verb_and_the_example_recipes_load():
    assert VERBS_BY_NAME["distill"].load().RECIPE is DistillRecipe
    recipe = load_config(DistillRecipe, "recipes/distill/gkd.yaml")
    assert recipe.objective.beta == 1.0 and recipe.teacher
    sft = load_config(SFTRecipe, "recipes/distill/sft_self_distill.yaml")
    assert sft.distill is not None and sft.distill.teacher == sft.checkpoint  # the pre-trained model teaches
    pre = load_config(PretrainRecipe, "recipes/distill/pretrain_kd.yaml")
    assert pre.distill is not None and pre.distill.top_k > 0


def refused(argv: list[str], capsys, match: str, not_written) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not not_written.exists()  # nothing written


def other_checkpoint(path, tokenizer_dir, vocab_size: int = 512, swap_tokens: bool = False):
    """A checkpoint of a model with ``vocab_size`` entries, its tokenizer ``tokenizer_dir``'s, or with
    ``swap_tokens`` the same tokenizer with two entries' ids exchanged (another tokenizer of the same size)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_hidden=64, max_seq_len=128))
    path.mkdir()
    write_model_files(path, model, tokenizer_dir)
    if swap_tokens:
        data = json.loads((path / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (path / "tokenizer.json").write_text(json.dumps(data))
    write_checksums(path)
    return path


def test_bad_teachers_are_one_line_exit_2_and_nothing_written(tmp_path, base_checkpoint, sft_data, shards_dir,  # noqa: F811
                                                              small_tokenizer_dir, prompts, capsys):
    wide = other_checkpoint(tmp_path / "wide", small_tokenizer_dir, vocab_size=640)
    swapped = other_checkpoint(tmp_path / "swapped", small_tokenizer_dir, swap_tokens=True)
    missing = tmp_path / "missing"
    run = tmp_path / "run"
    sft = ["sft", f"run_dir={run}", f"checkpoint={base_checkpoint}", f"data.train=[{sft_data / 'train.jsonl'}]",
           "data.max_length=128", "train.device=cpu"]
    refused([*sft, f"distill={{teacher: {swapped}}}"], capsys,
            f"distill.teacher: {swapped} was trained with another tokenizer than the student's", run)
    refused([*sft, f"distill={{teacher: {wide}}}"], capsys,
            f"distill.teacher: {wide} has a vocabulary of 640 entries, the student 512", run)
    refused([*sft, f"distill={{teacher: {missing}}}"], capsys, f"distill.teacher: {missing}: not a checkpoint", run)
    refused([*sft, f"distill={{teacher: {base_checkpoint}, temperature: 0}}"], capsys,
            "'distill.temperature' = 0", run)
    refused([*sft, f"distill={{teacher: {base_checkpoint}, temperature: -1}}"], capsys,
            "'distill.temperature' = -1", run)
    refused([*sft, f"distill={{teacher: {base_checkpoint}, replay: [{missing}]}}"], capsys, "distill.replay[0]: ", run)
    refused([*sft, f"distill={{teacher: {base_checkpoint}, replay: [{shards_dir}], top_k: 8}}"], capsys,
            "distill.replay distils replayed windows with the live teacher", run)
    pre = ["pretrain", *tiny_pretrain_overrides(run, shards_dir, small_tokenizer_dir, **{"train.max_steps": 2})]
    refused([*pre, f"distill={{teacher: {wide}}}"], capsys, f"distill.teacher: {wide} has a vocabulary of 640", run)
    refused([*pre, f"distill={{teacher: {swapped}}}"], capsys, "was trained with another tokenizer", run)
    refused([*pre, f"distill={{teacher: {base_checkpoint}, top_k: 600}}"], capsys,
            "distill.top_k 600 exceeds the vocabulary's 512 entries", run)
    refused([*pre, f"distill={{teacher: {base_checkpoint}, replay: [{shards_dir}]}}"], capsys,
            "distill.replay is sft's", run)
    gkd = ["distill", f"run_dir={run}", f"checkpoint={base_checkpoint}", f"data.train=[{prompts}]", "train.device=cpu"]
    refused([*gkd, f"teacher={missing}"], capsys, f"teacher: {missing}: not a checkpoint", run)
    refused([*gkd, f"teacher={swapped}"], capsys, f"teacher: {swapped} was trained with another tokenizer", run)
    refused([*gkd, f"teacher={base_checkpoint}", "objective.temperature=0"], capsys, "'objective.temperature' = 0", run)
    refused([*gkd, f"teacher={base_checkpoint}", "objective.beta=1.5"], capsys, "'objective.beta' = 1.5", run)
