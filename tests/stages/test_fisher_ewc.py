"""`lmforge fisher` and EWC in the training stages: the Fisher file beside a checkpoint (F of the windows,
the checkpoint's weights as anchor), its EWC++ fold, SFT with λ = 0 equal to plain SFT bit for bit, SFT
with EWC forgetting less of pre-training than without, and bad input refused in one line with nothing
written."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.preference_demo import make_pairs, write_jsonl
from lmforge.data.sft_demo import make_examples, write_demo
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.objectives.ewc import read_fisher, write_fisher
from lmforge.objectives.fisher import diagonal_fisher
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.stages.fisher import FisherRecipe, run_fisher
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, shards_dir, small_tokenizer_dir):  # noqa: F811
    """A tiny model pre-trained for 200 steps on the shards (its final checkpoint's directory): near enough to a
    minimum of its loss (4.3 nats/token) that the quadratic model of EWC describes what SFT costs it."""
    run = tmp_path_factory.mktemp("pretrained") / "run"
    run_pretrain(load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        run, shards_dir, small_tokenizer_dir, **{"train.max_steps": 200, "train.checkpoint_every": 200,
                                                 "train.eval_every": 0, "train.warmup_steps": 4,
                                                 "model.max_seq_len": 128})))
    _, directory = load_model(run)
    return directory


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data")
    write_demo(path, 120, seed=0, val_fraction=0.1)
    return path


def fisher_recipe(checkpoint, shards, *overrides) -> FisherRecipe:
    return load_config(FisherRecipe, None, [f"checkpoint={checkpoint}", f"data.shards={shards}", "data.seq_len=32",
                                            "max_tokens=320", *overrides])


def windows(shards, split: str = "train", n: int | None = None):
    loader = TokenLoader(LoaderConfig(datasets=[DatasetSource(str(shards))], seq_len=32, shuffle=False), 1, split=split,
                         loop=False)
    out = [(b[0, :-1], b[0, 1:]) for b in loader]
    return out[:n] if n is not None else out


def test_fisher_is_written_beside_the_checkpoint_with_its_weights_as_anchor(tmp_path, pretrained, shards_dir):  # noqa: F811
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(pretrained, checkpoint)
    result = run_fisher(fisher_recipe(checkpoint, shards_dir, "labels=empirical"))
    assert result["out"] == str(checkpoint / "fisher.safetensors") and result["tokens"] == 320
    fisher, anchor, meta = read_fisher(checkpoint)
    model, _ = load_model(checkpoint)
    expected, tokens, count = diagonal_fisher(model, windows(shards_dir), "empirical", max_tokens=320)
    assert (tokens, count, meta["labels"], meta["sequences"]) == (320, 10, "empirical", "10")
    for name, p in model.named_parameters():
        assert torch.equal(anchor[name], p.detach())
        torch.testing.assert_close(fisher[name], expected[name], rtol=1e-5, atol=0)  # same arithmetic, float32
    load_model(checkpoint)  # the checkpoint still verifies: its checksums do not list the new file
    from lmforge.stages.fisher import report

    assert report(result, tmp_path, tmp_path / "plot.png") == [
        f"- empirical Fisher of `{checkpoint}` over 320 target tokens (10 sequences), mean {result['mean_fisher']:.3g}; "
        f"in `{checkpoint / 'fisher.safetensors'}`"]


def test_fold_into_keeps_one_fisher_the_moving_average_anchored_at_the_new_checkpoint(tmp_path, pretrained,
                                                                                       base_checkpoint, shards_dir):  # noqa: F811
    old = run_fisher(fisher_recipe(base_checkpoint, shards_dir, f"out={tmp_path / 'old.safetensors'}"))
    new = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'new.safetensors'}"))
    folded = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'folded.safetensors'}",
                                      f"fold_into={old['out']}", "online_gamma=0.25"))
    f_old, _, _ = read_fisher(old["out"])
    f_new, a_new, _ = read_fisher(new["out"])
    f, a, meta = read_fisher(folded["out"])
    assert meta["folds"] == "1" and meta["online_gamma"] == "0.25"
    for name in f:
        torch.testing.assert_close(f[name], 0.25 * f_old[name] + 0.75 * f_new[name], rtol=1e-6, atol=0)
        assert torch.equal(a[name], a_new[name])


def sft_recipe(tmp_path, name, base, data, *overrides) -> SFTRecipe:
    return load_config(SFTRecipe, None, [
        f"run_dir={tmp_path / name}", f"checkpoint={base}", f"data.train=[{data / 'train.jsonl'}]",
        "data.max_length=128", "train.max_steps=8", "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4",
        "train.batch_tokens=512", "train.precision=fp32", "train.eval_every=0", "train.tensorboard=false",
        "train.device=cpu", *overrides])


def test_sft_with_lambda_zero_trains_bit_for_bit_as_without_ewc(tmp_path, pretrained, shards_dir, sft_data):  # noqa: F811
    fisher = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'f.safetensors'}"))["out"]
    run_sft(sft_recipe(tmp_path, "plain", pretrained, sft_data))
    run_sft(sft_recipe(tmp_path, "zero", pretrained, sft_data, f"ewc={{fisher: {fisher}, lambda_: 0}}"))
    plain, zero = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "zero")
    assert [r["loss"] for r in plain if "loss" in r] == [r["loss"] for r in zero if "loss" in r]
    assert [r["grad_norm"] for r in plain if "loss" in r] == [r["grad_norm"] for r in zero if "loss" in r]
    assert all(r["ewc/penalty"] == 0.0 for r in zero if "loss" in r)
    a, _ = load_model(tmp_path / "plain")
    b, _ = load_model(tmp_path / "zero")
    assert all(torch.equal(p, b.state_dict()[n]) for n, p in a.state_dict().items())


def pretraining_loss(checkpoint, shards) -> float:
    model, _ = load_model(checkpoint)
    batch = torch.stack([torch.cat([x[:1], y]) for x, y in windows(shards, "val", 16)])
    with torch.no_grad():
        return float(CausalLMObjective()(model, batch).loss_sum) / CausalLMObjective().num_targets(batch)


@pytest.mark.parametrize("lora", [False, True])
def test_sft_with_ewc_forgets_less_of_pretraining_than_without(tmp_path, pretrained, shards_dir, sft_data, lora):  # noqa: F811
    fisher = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'f.safetensors'}", "max_tokens=640"))
    extra = ["lora={r: 4, alpha: 8}", "train.lr=1e-2"] if lora else []
    naive = run_sft(sft_recipe(tmp_path, "naive", pretrained, sft_data, *extra))
    ewc = run_sft(sft_recipe(tmp_path, "ewc", pretrained, sft_data, *extra,
                             f"ewc={{fisher: {fisher['out']}, lambda_: 1000}}"))
    before = pretraining_loss(pretrained, shards_dir)
    after_naive = pretraining_loss(naive["final_checkpoint"], shards_dir)
    after_ewc = pretraining_loss(ewc["final_checkpoint"], shards_dir)
    # SFT's chat data raises the pre-training loss (by 0.39 nats/token in full fine-tuning); the penalty at
    # λ = 1000 keeps 0.15 of it (measured: λ = 100, 1e4, 1e5 keep 0.33, 0.034, 0.018), while SFT still learns
    assert after_naive - before > 0.1
    assert after_ewc - before < 0.5 * (after_naive - before), (before, after_naive, after_ewc)
    rows = [r for r in read_metrics(tmp_path / "ewc") if "loss" in r]
    assert rows[0]["ewc/penalty"] == 0.0 and rows[-1]["ewc/penalty"] > 0  # the run starts at the anchor and moves away
    assert rows[-1]["loss"] - rows[-1]["ewc/penalty"] < rows[0]["loss"] - 0.1  # the SFT loss itself falls


def refused(argv: list[str], capsys, match: str, not_written) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not not_written.exists()  # nothing written


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, pretrained, shards_dir, sft_data,  # noqa: F811
                                                          base_checkpoint, capsys):
    other = tmp_path / "other.safetensors"  # the Fisher of a model half as wide
    model = Transformer(ModelConfig(vocab_size=512, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64,
                                    max_seq_len=128))
    state = {n: p.detach() for n, p in model.named_parameters()}
    write_fisher(other, {n: t.square() for n, t in state.items()}, state, {"labels": "sampled"})
    run = tmp_path / "run"
    sft = ["sft", f"run_dir={run}", f"checkpoint={pretrained}", f"data.train=[{sft_data / 'train.jsonl'}]",
           "train.device=cpu"]
    refused([*sft, f"ewc={{fisher: {other}, lambda_: 1}}"], capsys, f"ewc.fisher: {other} holds embed.weight of shape "
            "(512, 16), the model's is (512, 32)", run)
    refused([*sft, f"ewc={{fisher: {other}, lambda_: -1}}"], capsys, "'ewc.lambda_' = -1", run)
    refused([*sft, f"ewc={{fisher: {tmp_path / 'missing.safetensors'}}}"], capsys, "ewc.fisher: ", run)
    pre = ["pretrain", *tiny_pretrain_overrides(run, shards_dir, pretrained, **{"train.max_steps": 2}),
           f"ewc={{fisher: {other}}}"]
    refused(pre, capsys, f"ewc.fisher: {other} holds embed.weight", run)
    out = tmp_path / "f.safetensors"
    fisher = ["fisher", f"checkpoint={pretrained}", f"data.shards={shards_dir}", f"out={out}"]
    refused([*fisher, f"fold_into={other}", "online_gamma=1.5"], capsys, "'online_gamma' = 1.5: must be in [0, 1]", out)
    refused([*fisher, f"fold_into={other}"], capsys, f"fold_into: {other} holds embed.weight", out)
    refused([*fisher, "online_gamma=0.3"], capsys, "online_gamma: it weighs a stored Fisher (fold_into)", out)
    refused(["fisher", f"checkpoint={pretrained}", f"out={out}"], capsys, "data: give data.shards", out)


def test_continued_pretraining_with_ewc_resumes_exactly_mid_run(tmp_path, pretrained, shards_dir,  # noqa: F811
                                                                 small_tokenizer_dir):
    fisher = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'f.safetensors'}"))["out"]

    def recipe(name: str, **overrides) -> PretrainRecipe:
        keys = {"init": str(pretrained), "ewc": f"{{fisher: {fisher}, lambda_: 1000}}", "model.max_seq_len": 128,
                "train.lr": 3e-2, "train.eval_every": 0, "train.checkpoint_every": 4, **overrides}
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(tmp_path / name, shards_dir,
                                                                         small_tokenizer_dir, **keys))

    run_pretrain(recipe("whole"))
    run_pretrain(recipe("resumed", **{"train.stop_at_step": 4}))
    run_pretrain(recipe("resumed"))
    whole = [(r["step"], r["loss"], r["ewc/penalty"]) for r in read_metrics(tmp_path / "whole") if "loss" in r]
    resumed = [(r["step"], r["loss"], r["ewc/penalty"]) for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    assert [s for s, _, _ in whole] == list(range(1, 9)) and whole[0][2] == 0.0 and whole[-1][2] > 0
    assert resumed == whole  # bit for bit: the penalty holds no state beyond F, θ* and the weights


def test_dpo_adds_the_penalty_to_its_loss(tmp_path, pretrained, shards_dir):  # noqa: F811
    fisher = run_fisher(fisher_recipe(pretrained, shards_dir, f"out={tmp_path / 'f.safetensors'}"))["out"]
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, make_pairs(make_examples(16, seed=3)))

    def dpo(name: str, *overrides: str) -> list[dict]:
        run_dpo(load_config(DPORecipe, None, [
            f"run_dir={tmp_path / name}", f"checkpoint={pretrained}", f"data.train=[{pairs}]", "data.max_length=96",
            "train.max_steps=3", "train.warmup_steps=0", "train.lr=1e-3", "train.micro_batch_size=4",
            "train.precision=fp32", "train.eval_every=0", "train.tensorboard=false", "train.device=cpu", *overrides]))
        return [r for r in read_metrics(tmp_path / name) if "loss" in r]

    plain, ewc = dpo("plain"), dpo("ewc", f"ewc={{fisher: {fisher}, lambda_: 1000}}")
    assert ewc[0]["loss"] == plain[0]["loss"] and ewc[0]["ewc/penalty"] == 0.0  # at the anchor: nothing added
    assert ewc[-1]["ewc/penalty"] > 0 and ewc[-1]["loss"] != plain[-1]["loss"]
