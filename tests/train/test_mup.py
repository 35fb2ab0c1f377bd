"""µP (``model.mup``): the parameterisation is the standard one at the base width, its rules
(init, per-group learning rates, the readout multiplier, the attention scale) are those of
Yang et al. 2021's Table 8, and the coordinate check: after a few steps each layer's activation
scale stays flat across widths under µP and grows with width under the standard parameterisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.checkpoints.files import load_model_config, write_model_config
from lmforge.core.config import ConfigError
from lmforge.model.families import build, model_config
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.loop import TrainConfig
from lmforge.train.metrics import read_metrics
from lmforge.train.muon import MuonConfig
from lmforge.train.optim import build_optimizer

BASE = 64


def config(width: int, mup: bool = True, **keys):
    """A 2-layer model whose every hidden size grows with ``width`` (heads of 16 are added)."""
    return model_config(dict(vocab_size=256, d_model=width, n_layers=2, n_heads=width // 16, ffn_hidden=4 * width,
                             max_seq_len=64, **({"mup": {"base_width": BASE}} if mup else {}), **keys))


def seeded(cfg):
    torch.manual_seed(0)
    return build(cfg)


def test_at_the_base_width_mup_is_the_standard_model_and_optimizer():
    sp, mup = seeded(config(BASE, mup=False)), seeded(config(BASE))
    for (name, a), (_, b) in zip(sp.state_dict().items(), mup.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(sp(tokens), mup(tokens))
    train = TrainConfig(lr=1e-3)
    assert [g["lr"] for g in build_optimizer(mup, train).param_groups] == [1e-3, 1e-3]


def test_init_scales_the_hidden_matrices_by_one_over_root_m_and_keeps_the_rest():
    m = 8  # width 512 over base 64
    model = seeded(config(BASE * m))
    stds = {name: p.std().item() for name, p in model.named_parameters() if p.ndim == 2}
    # 512 x 512 draws: the sample std is within 1% of the true one (its relative error is ~1/sqrt(2n))
    assert stds["layers.0.attn.wq.weight"] == pytest.approx(0.02 / math.sqrt(m), rel=0.01)
    assert stds["layers.0.mlp.w1.weight"] == pytest.approx(0.02 / math.sqrt(m), rel=0.01)
    assert stds["layers.0.attn.wo.weight"] == pytest.approx(0.02 / math.sqrt(m) / 2, rel=0.01)  # / sqrt(2 layers)
    assert stds["embed.weight"] == pytest.approx(0.02, rel=0.01)
    assert stds["lm_head.weight"] == pytest.approx(0.02, rel=0.01)


def test_the_readout_multiplies_the_heads_output_by_one_over_m():
    model = seeded(config(256)).eval()
    tokens = torch.randint(0, 256, (2, 16))
    expected = model.lm_head(model.hidden_states(tokens)) * (BASE / 256)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-6, atol=1e-6)


def test_base_head_dim_scales_the_scores_by_one_over_head_dim():
    # heads widen with the model: 4 heads of 64 over a base whose heads were 16 wide
    model = seeded(model_config(dict(vocab_size=256, d_model=256, n_layers=1, n_heads=4, max_seq_len=32,
                                     mup={"base_width": BASE, "base_head_dim": 16})))
    assert model.layers[0].attn.scale == pytest.approx(math.sqrt(16) / 64)
    assert seeded(config(256)).layers[0].attn.scale is None  # heads added: the family's own 1/sqrt(head_dim)


def rates(model, **train) -> dict[str, float]:
    optimizer = build_optimizer(model, TrainConfig(**train))
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["peak_lr"] for g in optimizer.param_groups for p in g["params"]}


def test_adam_trains_the_hidden_matrices_at_lr_over_m_and_the_rest_at_lr():
    lr = rates(seeded(config(256)), lr=1e-2)  # m = 4
    hidden = {n for n in lr if n.startswith("layers.") and n.endswith("weight") and "norm" not in n}
    assert hidden and all(lr[n] == pytest.approx(2.5e-3) for n in hidden)
    assert all(lr[n] == 1e-2 for n in set(lr) - hidden)  # embedding, head, norm gains
    assert {"embed.weight", "lm_head.weight", "norm.weight"} <= set(lr) - hidden


@pytest.mark.parametrize("scale,expected", [("shape", 0.02), ("adamw_rms", 0.005)])
def test_muons_matrices_keep_their_rate_with_the_shape_scale_and_divide_it_with_adamws_rms(scale, expected):
    lr = rates(seeded(config(256)), lr=1e-2, optimizer="muon", muon=MuonConfig(lr=0.02, scale=scale))
    assert lr["layers.1.mlp.w2.weight"] == pytest.approx(expected)
    assert lr["embed.weight"] == lr["lm_head.weight"] == 1e-2


def test_lora_factors_keep_adams_rate():
    from lmforge.peft.lora import LoraConfig, apply_lora

    model = seeded(config(256))
    apply_lora(model, LoraConfig(r=4))
    lr = rates(model, lr=1e-2)
    assert lr and all(v == 1e-2 for n, v in lr.items() if "lora_" in n)


def test_lamb_with_mup_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"model.mup is set with train.optimizer = lamb"):
        build_optimizer(seeded(config(256)), TrainConfig(optimizer="lamb"))


@pytest.mark.parametrize("keys,match", [
    ({"mup": {"base_width": 512}}, r"model.mup.base_width = 512 is larger than model.d_model = 256"),
    ({"mup": {"base_width": 64, "base_head_dim": 128}}, r"model.mup.base_head_dim = 128 is larger than head_dim = 16"),
    ({"mup": {"base_head_dim": 8}}, r"model.mup.base_head_dim is set but model.mup.base_width is not"),
])
def test_a_base_wider_than_the_model_is_one_line_naming_the_key(keys, match):
    with pytest.raises(ValueError, match=match):
        model_config(dict(vocab_size=256, d_model=256, n_heads=16, **keys))


@pytest.mark.parametrize("overrides,message", [
    (["model.mup.base_width=64"], "model.mup.base_width = 64 is larger than model.d_model = 32"),
    (["model.mup.base_width=16", "train.optimizer=lamb"], "model.mup is set with train.optimizer = lamb"),
])
def test_a_bad_mup_recipe_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, overrides, message):
    from lmforge.cli.main import main

    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\nmodel:\n  d_model: 32\n  n_heads: 2\n")
    assert main(["pretrain", str(recipe), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_base_width_is_saved_with_the_checkpoint(tmp_path):
    cfg = config(128)
    write_model_config(tmp_path, cfg, None)
    loaded = load_model_config(tmp_path)
    assert loaded == cfg and loaded.mup.base_width == BASE and loaded.width_mult() == 2.0


# ---- the coordinate check (Yang et al. 2021, section 4 and microsoft/mup's ``get_coord_data``)

WIDTHS = (64, 128, 256, 512)


def coordinates(width: int, mup: bool, optimizer: str, steps: int = 5) -> dict[str, float]:
    """Mean |x| of the embedding's output, each block's output and the logits, on a fixed batch,
    after ``steps`` steps of full-batch training at a fixed rate (no warm-up, no decay)."""
    model = seeded(config(width, mup))
    train = TrainConfig(lr=1e-2, optimizer=optimizer, muon=MuonConfig(lr=0.02), weight_decay=0.0, warmup_steps=0,
                        schedule="constant", max_steps=steps)
    optimizer = build_optimizer(model, train)
    data = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    scale: dict[str, float] = {}
    model.embed.register_forward_hook(lambda m, i, out: scale.__setitem__("embed", out.abs().mean().item()))
    for n, block in enumerate(model.layers):
        block.register_forward_hook(lambda m, i, out, n=n: scale.__setitem__(f"block {n}", out.abs().mean().item()))
    for _ in range(steps):
        loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        scale["logits"] = model(data[:, :-1]).abs().mean().item()
    return scale


@pytest.fixture(scope="module")
def coord_data() -> dict[tuple[bool, str], dict[int, dict[str, float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic whatever the machine's core count
    try:
        return {(mup, opt): {w: coordinates(w, mup, opt) for w in WIDTHS}
                for mup, opt in [(True, "adamw"), (False, "adamw"), (True, "muon")]}
    finally:
        torch.set_num_threads(threads)  # the tests after it keep their process's count


def spread(by_width: dict[int, dict[str, float]], key: str) -> float:
    values = [by_width[w][key] for w in WIDTHS]
    return max(values) / min(values)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_under_mup_every_layers_scale_stays_within_2x_from_width_64_to_512(coord_data, optimizer):
    by_width = coord_data[(True, optimizer)]
    for key in by_width[64]:
        assert spread(by_width, key) < 2.0, (key, {w: by_width[w][key] for w in WIDTHS})


def test_under_the_standard_parameterisation_the_hidden_and_output_scales_grow_with_width(coord_data):
    # Adam moves every weight by about lr a step, so a matrix's update moves its output by about
    # lr * fan_in: a 512-wide block's by 8x a 64-wide one's, and more as the blocks compound
    by_width = coord_data[(False, "adamw")]
    for key in ("block 0", "block 1", "logits"):
        values = [by_width[w][key] for w in WIDTHS]
        assert values == sorted(values) and values[-1] > 4 * values[0], (key, values)
    assert spread(by_width, "embed") < 2.0  # an embedding row's update does not grow with width


# ---- a whole run


def test_a_mup_run_trains_and_resumes_exactly(make_recipe, tmp_path):
    keys = {"model.d_model": 64, "model.n_heads": 4, "model.ffn_hidden": 128, "model.mup.base_width": 32,
            "train.max_steps": 8}
    run_pretrain(make_recipe(tmp_path / "full", **keys))
    full = [r["loss"] for r in read_metrics(tmp_path / "full")]
    assert full[-1] < full[0]
    run_pretrain(make_recipe(tmp_path / "half", **keys, **{"train.stop_at_step": 4}))
    run_pretrain(make_recipe(tmp_path / "half", **keys))
    assert [r["loss"] for r in read_metrics(tmp_path / "half")] == full
    assert load_model_config(tmp_path / "full" / "checkpoints" / "step_00000008").mup.base_width == 32
