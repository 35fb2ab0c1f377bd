"""`lmforge merge`: closed forms on full checkpoints, adapters into a checkpoint, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.files import WEIGHTS, load_model_config, write_checksums, write_model_files
from lmforge.checkpoints.load import load_model, read_checkpoint_weights
from lmforge.cli.main import main
from lmforge.core.io import atomic_directory
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import load_adapter, save_adapter
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules, merge_lora
from lmforge.peft.merge import read_adapter
from lmforge.stages.export import ExportRecipe, run_export

pytestmark = pytest.mark.usefixtures("one_thread")


def fine_tuned(path: Path, base: Path, tokenizer: Path, task: dict[str, torch.Tensor] | None = None, seed: int = 0,
               **cfg_fields) -> Path:
    """A checkpoint of the base's model plus a task vector (random, or ``task``)."""
    model, _ = load_model(base)
    if cfg_fields:
        model = Transformer(ModelConfig(**{**model.cfg.__dict__, **cfg_fields}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(task[name] if task is not None else 0.01 * torch.randn(p.shape, generator=g))
    with atomic_directory(path) as tmp:
        write_model_files(tmp, model, tokenizer)
        write_checksums(tmp)
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint_weights(load_model(path)[1])


@pytest.fixture()
def runs(tmp_path, base_checkpoint, small_tokenizer_dir) -> dict[str, Path]:
    return {"base": base_checkpoint, "a": fine_tuned(tmp_path / "a", base_checkpoint, small_tokenizer_dir, seed=1),
            "b": fine_tuned(tmp_path / "b", base_checkpoint, small_tokenizer_dir, seed=2)}


def test_linear_of_two_checkpoints_is_their_mean_and_a_checkpoint_every_verb_reads(runs, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge", str(runs["a"]), str(runs["b"]), "--out", str(out)]) == 0
    a, b, merged = weights(runs["a"]), weights(runs["b"]), weights(out)  # load_model verifies the checksums
    assert set(merged) == set(a)
    for k in a:
        torch.testing.assert_close(merged[k], (a[k] + b[k]) / 2, rtol=0, atol=0)  # (1·a + 1·b)/2 in float32: exact
    record = json.loads((out / "merge.json").read_text())
    assert (record["method"], [i["weight"] for i in record["inputs"]]) == ("linear", [1.0, 1.0])
    assert load_model_config(out) == load_model_config(runs["a"])
    assert (out / "tokenizer.json").read_bytes() == (runs["a"] / "tokenizer.json").read_bytes()
    run_export(ExportRecipe(checkpoint=str(out), run_dir=str(tmp_path / "hf")))  # export reads it
    assert (tmp_path / "hf" / "config.json").is_file()
    repo = Path(__file__).resolve().parents[2]
    assert main(["eval", str(out), "--tasks", str(repo / "data/eval/demo_choices.yaml"), "--limit", "2",
                 "--out", str(tmp_path / "eval")]) == 0  # and eval scores it
    assert (tmp_path / "eval" / "results.json").is_file()
    # weights 3 and 1: (3a + b)/4
    assert main(["merge", str(runs["a"]), str(runs["b"]), "--weights", "3", "1", "--out", str(out)]) == 0
    merged = weights(out)
    for k in a:
        torch.testing.assert_close(merged[k], (3 * a[k] + b[k]) / 4, rtol=1e-6, atol=1e-7)


def test_task_arithmetic_closed_forms(runs, tmp_path):
    base, a, b = weights(runs["base"]), weights(runs["a"]), weights(runs["b"])
    one = tmp_path / "one"
    assert main(["merge", str(runs["a"]), "--method", "task_arithmetic", "--base", str(runs["base"]), "--out", str(one)]) == 0
    for k, v in weights(one).items():  # λ = 1, one model: base + (a - base) = a, to float32 rounding (|w| < 1: 1e-7)
        torch.testing.assert_close(v, a[k], rtol=0, atol=2e-7)
    two = tmp_path / "two"
    assert main(["merge", str(runs["a"]), str(runs["b"]), "--method", "task_arithmetic", "--base", str(runs["base"]),
                 "--out", str(two), "scale=0.5"]) == 0
    for k, v in weights(two).items():  # base + 0.5 (τa + τb) = the mean here
        torch.testing.assert_close(v, base[k] + 0.5 * ((a[k] - base[k]) + (b[k] - base[k])), rtol=0, atol=2e-7)
        torch.testing.assert_close(v, (a[k] + b[k]) / 2, rtol=0, atol=4e-7)


def test_ties_with_density_1_and_agreeing_signs_is_linear_and_trims_otherwise(runs, tmp_path, small_tokenizer_dir):
    base = weights(runs["base"])
    # task vectors [τ, 2τ]: every sign agrees, so the disjoint mean is (τ + 2τ)/2, the mean of the two models
    g = torch.Generator().manual_seed(5)
    tau = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    a = fine_tuned(tmp_path / "ta", runs["base"], small_tokenizer_dir, task=tau)
    b = fine_tuned(tmp_path / "tb", runs["base"], small_tokenizer_dir, task={k: 2 * v for k, v in tau.items()})
    ties, linear = tmp_path / "ties", tmp_path / "linear"
    assert main(["merge", str(a), str(b), "--method", "ties", "--base", str(runs["base"]), "--out", str(ties)]) == 0
    assert main(["merge", str(a), str(b), "--out", str(linear)]) == 0
    for k, v in weights(ties).items():
        torch.testing.assert_close(v, weights(linear)[k], rtol=0, atol=4e-7)
        torch.testing.assert_close(v, base[k] + 1.5 * tau[k], rtol=0, atol=4e-7)
    # density 0.25: only the quarter of largest |τ| of each tensor moves away from the base
    assert main(["merge", str(a), str(b), "--method", "ties", "--base", str(runs["base"]), "--out", str(ties),
                 "density=0.25"]) == 0
    merged = weights(ties)
    name = "layers.0.attn.wq.weight"
    moved = (merged[name] - base[name]).abs() > 1e-7
    assert moved.sum().item() == int(0.25 * moved.numel())


def test_dare_is_seeded_and_with_no_drop_is_task_arithmetic_as_is_magnitude_prune_keeping_all(runs, tmp_path):
    def dare(out: str, *extra: str) -> Path:
        assert main(["merge", str(runs["a"]), str(runs["b"]), "--method", "dare_linear", "--base", str(runs["base"]),
                     "--out", str(tmp_path / out), *extra]) == 0
        return tmp_path / out

    one, again, other = dare("s1", "drop_rate=0.5", "seed=1"), dare("s1b", "drop_rate=0.5", "seed=1"), dare("s2", "drop_rate=0.5", "seed=2")
    assert load_file(str(one / WEIGHTS)).keys() == load_file(str(again / WEIGHTS)).keys()
    assert all(torch.equal(v, weights(again)[k]) for k, v in weights(one).items())
    assert not all(torch.equal(v, weights(other)[k]) for k, v in weights(one).items())
    assert main(["merge", str(runs["a"]), str(runs["b"]), "--method", "task_arithmetic", "--base", str(runs["base"]),
                 "--out", str(tmp_path / "ta")]) == 0
    for k, v in weights(dare("p0")).items():
        torch.testing.assert_close(v, weights(tmp_path / "ta")[k], rtol=0, atol=0)
    # magnitude_prune keeps everything at density 1: task arithmetic again
    assert main(["merge", str(runs["a"]), str(runs["b"]), "--method", "magnitude_prune", "--base", str(runs["base"]),
                 "--out", str(tmp_path / "mp")]) == 0
    for k, v in weights(tmp_path / "mp").items():
        torch.testing.assert_close(v, weights(tmp_path / "ta")[k], rtol=0, atol=0)


@pytest.fixture()
def adapter_runs(tmp_path, base_checkpoint) -> dict[str, Path]:
    """Two LoRA adapters (rank 4) and one of rank 2 over the base, and one over another base."""
    run_export(ExportRecipe(checkpoint=str(base_checkpoint), run_dir=str(tmp_path / "base-hf")))
    paths = {}
    for name, r, seed in (("a", 4, 1), ("b", 4, 2), ("c", 2, 3)):
        model, _ = load_model(base_checkpoint)
        lora = LoraConfig(r=r, alpha=2.0 * r, target_modules=["attn.wq", "mlp.w2"])
        apply_lora(model, lora)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in lora_modules(model).values():
                module.lora_A.weight.copy_(0.3 * torch.randn(module.lora_A.weight.shape, generator=g))
                module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=g))
        paths[name] = save_adapter(model, lora, tmp_path / f"adapter-{name}", base_model_name_or_path=str(tmp_path / "base-hf"))
    return paths


def test_adapters_merge_into_an_adapter_or_into_their_base_checkpoint(adapter_runs, base_checkpoint, tmp_path):
    merged, folded = tmp_path / "merged-adapter", tmp_path / "merged-ckpt"
    args = [str(adapter_runs["a"]), str(adapter_runs["c"]), "--method", "cat", "--weights", "0.5", "0.5"]
    assert main(["merge", *args, "--out", str(merged), "scale=2"]) == 0
    config = json.loads((merged / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (6, 12.0, False)  # scaling = α/r = scale
    assert main(["merge", *args, "--output", "checkpoint", "--base", str(base_checkpoint), "--out", str(folded),
                 "scale=2"]) == 0
    # the checkpoint is the base with the merged adapter merged in, as `export --merge-lora` merges one
    model, _ = load_model(base_checkpoint)
    load_adapter(model, merged)
    merge_lora(model)
    expected = {k: v for k, v in model.state_dict().items() if k in weights(folded)}
    for k, v in weights(folded).items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)
    # cat of weights 1/2 at scale 2 is the exact sum of the two updates, s_a B_a A_a + s_c B_c A_c
    base = weights(base_checkpoint)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    update = sum(ad.scaling * ad.factors[module][1] @ ad.factors[module][0]
                 for _, ad in (read_adapter(adapter_runs["a"]), read_adapter(adapter_runs["c"])))
    torch.testing.assert_close(weights(folded)["layers.0.attn.wq.weight"], base["layers.0.attn.wq.weight"] + update,
                               rtol=0, atol=1e-6)
    tok = json.loads((folded / "tokenizer_config.json").read_text())
    assert "im_start" in tok["chat_template"]  # the adapters were trained on ChatML
    assert not torch.equal(weights(folded)["layers.0.attn.wq.weight"], base["layers.0.attn.wq.weight"])
    assert torch.equal(weights(folded)["layers.0.attn.wk.weight"], base["layers.0.attn.wk.weight"])  # not adapted


def refused(argv: list[str], capsys, out: Path, match: str) -> None:
    assert main(["merge", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmforge merge: error: "), err
    assert match in err[0], err[0]
    assert not out.exists()  # nothing written


def test_bad_input_is_one_line_naming_the_key_exit_2_and_nothing_written(runs, adapter_runs, base_checkpoint, tmp_path,
                                                                          small_tokenizer_dir, capsys):
    out = tmp_path / "out"
    a, b, base = str(runs["a"]), str(runs["b"]), str(runs["base"])
    refused([a, str(tmp_path / "missing")], capsys, out, "inputs[1].path: ")
    refused([a, b, "--method", "ties", "--base", base, "density=0"], capsys, out, "'density' = 0: must be in (0, 1]")
    refused([a, b, "--method", "dare_ties", "--base", base, "drop_rate=1"], capsys, out, "'drop_rate' = 1: must be in [0, 1)")
    refused([a, "--method", "ties", "--base", base], capsys, out, "inputs: ties merges at least 2 inputs, got 1")
    refused([a, b, "--method", "ties"], capsys, out, "base: ties merges task vectors")
    refused([a, b, "density=0.5"], capsys, out, "density: only ties and magnitude_prune (and their svd types) trim")
    refused([a, b, "--method", "svd"], capsys, out, "method: svd merges LoRA adapters' factors or updates")
    refused([str(adapter_runs["a"]), str(adapter_runs["b"]), "--method", "svd", "svd_rank=40"], capsys, out,
            "svd_rank: 40 exceeds the rank 32 of an update")
    refused([a, b, "--weights", "1"], capsys, out, "--weights: 1 weights for 2 inputs")
    wide = fine_tuned(tmp_path / "wide", runs["base"], small_tokenizer_dir, d_model=64, ffn_hidden=128)
    refused([a, str(wide)], capsys, out, "'d_model' (32 vs 64): only checkpoints of one model shape and family merge")
    refused([str(adapter_runs["a"]), a], capsys, out, "merge adapters with adapters")
    refused([str(adapter_runs["a"]), str(adapter_runs["c"])], capsys, out, "inputs[1].path: ")  # ranks 4 and 2
    refused([str(adapter_runs["a"]), str(adapter_runs["b"]), "--method", "task_arithmetic"], capsys, out, "method=cat")
    # an adapter over another base: its adapter_config.json names a base whose weights differ
    other = tmp_path / "other-hf"
    torch.manual_seed(9)
    with atomic_directory(tmp_path / "other") as tmp:
        write_model_files(tmp, Transformer(load_model_config(base_checkpoint)), small_tokenizer_dir)
        write_checksums(tmp)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "other"), run_dir=str(other)))
    capsys.readouterr()  # the export's log line
    moved = tmp_path / "b-other"
    moved.mkdir()
    config = json.loads((adapter_runs["b"] / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(other)}))
    (moved / "adapter_model.safetensors").write_bytes((adapter_runs["b"] / "adapter_model.safetensors").read_bytes())
    refused([str(adapter_runs["a"]), str(moved)], capsys, out, "adapters over different bases do not merge")
    refused([str(adapter_runs["a"]), str(adapter_runs["b"]), "--output", "checkpoint", "--base", str(tmp_path / "other")],
            capsys, out, "is not the base the adapters were trained on")
    # an output folder that is an input, or some other folder, is not replaced
    assert main(["merge", a, b, "--out", a]) == 2 and "would replace the input" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert main(["merge", a, b, "--out", str(tmp_path / "notes")]) == 2
    assert "is not an earlier merge" in capsys.readouterr().err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_lifecycle_stage_merges_once_and_skips_when_complete(runs, tmp_path):
    from lmforge.core.config import load_config
    from lmforge.stages.lifecycle import LifecycleRecipe, run_lifecycle

    (tmp_path / "merge.yaml").write_text(
        f"method: ties\nbase: {runs['base']}\ndensity: 0.5\ninputs:\n  - path: {runs['a']}\n  - path: {runs['b']}\n"
        f"run_dir: {tmp_path / 'life' / 'merged'}\n")
    (tmp_path / "life.yaml").write_text(f"run_dir: {tmp_path / 'life'}\nstages:\n  - verb: merge\n    recipe: "
                                        f"{tmp_path / 'merge.yaml'}\n")
    recipe = load_config(LifecycleRecipe, tmp_path / "life.yaml")
    first = run_lifecycle(recipe)
    assert first[0]["status"] == "ran" and load_model(tmp_path / "life" / "merged")[0] is not None
    assert run_lifecycle(recipe)[0]["status"] == "skipped"
    report = (tmp_path / "life" / "report.md").read_text()
    assert "ties of 2 checkpoints" in report and "density 0.5" in report
