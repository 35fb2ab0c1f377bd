"""Muon and LAMB (``train.optimizer``): each step against a reference written out here from the
papers' formulas (float64 or float32, so 1e-6 is many rounding errors wide), against the
installed reference implementations (``torch.optim.Muon``, ``torch_optimizer.Lamb``), the rule
that splits Muon's matrices from AdamW's parameters for every family, and whole runs: the loss
falls and a resumed run repeats the uninterrupted one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmforge.core.config import ConfigError, load_config
from lmforge.model.families import FAMILIES, build, model_config
from lmforge.peft.lora import LoraConfig, apply_lora
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.lamb import Lamb
from lmforge.train.loop import TrainConfig
from lmforge.train.metrics import read_metrics
from lmforge.train.muon import POLAR_EXPRESS_COEFFICIENTS, Muon, MuonConfig, newton_schulz
from lmforge.train.optim import build_optimizer, param_groups

# ---- the references, written from the formulas


def reference_newton_schulz(g: torch.Tensor, coefficients: list[tuple[float, float, float]], norm_factor: float,
                            eps: float) -> torch.Tensor:
    """Jordan et al.'s iteration as his post writes it: X = G/(c‖G‖ + eps); X <- aX + bAX + cA²X, A = XXᵀ."""
    x = g.clone()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / (norm_factor * torch.sqrt((x * x).sum()) + eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if transpose else x


def random_matrix(rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)], ids=["tall", "wide", "square"])
def test_newton_schulz_is_jordans_quintic_iteration(shape):
    g = random_matrix(*shape, dtype=torch.float64)
    ours = newton_schulz(g, steps=5, coefficients="jordan", dtype=torch.float64)
    ref = reference_newton_schulz(g, [(3.4445, -4.7750, 2.0315)] * 5, 1.0, 1e-7)
    assert ours.shape == g.shape and ours.dtype == g.dtype
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    # in fp32 (train.muon.ns_dtype: fp32) the same to fp32 rounding: ~1e-7 per product, 15 products
    torch.testing.assert_close(newton_schulz(g.float(), 5, "jordan", torch.float32).double(), ref, rtol=0, atol=1e-5)
    # the iteration keeps G's singular vectors and maps each singular value σ of G/‖G‖ through the
    # quintic p(x) = ax + bx³ + cx⁵ five times: those of 1% of ‖G‖ or more land in 0.68-1.2
    x = torch.linalg.svdvals(g) / g.norm()
    for _ in range(5):
        x = 3.4445 * x - 4.7750 * x ** 3 + 2.0315 * x ** 5
    torch.testing.assert_close(torch.linalg.svdvals(ours), x.sort(descending=True).values, rtol=0, atol=1e-6)
    lifted = x[torch.linalg.svdvals(g) >= 0.01 * g.norm()]
    assert lifted.min() > 0.6 and lifted.max() < 1.25


def test_polar_express_uses_a_triple_per_step_and_orthogonalises_more_tightly():
    g = random_matrix(64, 32, seed=1, dtype=torch.float64)
    ours = newton_schulz(g, steps=5, coefficients="polar_express", dtype=torch.float64)
    ref = reference_newton_schulz(g, list(POLAR_EXPRESS_COEFFICIENTS), 1.01, 1e-6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    jordan = torch.linalg.svdvals(newton_schulz(g, 5, "jordan", torch.float64))
    polar = torch.linalg.svdvals(ours)
    assert (polar - 1).abs().max() < (jordan - 1).abs().max()


def test_newton_schulz_in_bf16_is_torchs_own_muon_iteration():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = random_matrix(96, 64, seed=2)
    ours = newton_schulz(g, 5, "jordan", torch.bfloat16).float()
    torchs = _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    # the same products in the same order (addmm for bA + cA² and for aX + BX): the same roundings
    assert torch.equal(ours, torchs)


def reference_muon_steps(w: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float, nesterov: bool,
                         decay: float, scale: str) -> torch.Tensor:
    """Muon as KellerJordan/Muon's muon_update writes it, in float64 with the fp32 iteration above."""
    w, m = w.clone(), torch.zeros_like(w)
    rows, cols = w.shape
    s = math.sqrt(max(1.0, rows / cols)) if scale == "shape" else 0.2 * math.sqrt(max(rows, cols))
    for g in grads:
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m if nesterov else m
        o = reference_newton_schulz(u, [(3.4445, -4.7750, 2.0315)] * 5, 1.0, 1e-7)
        w = w * (1 - lr * decay) - lr * s * o
    return w


@pytest.mark.parametrize("nesterov,decay,scale", [(True, 0.0, "shape"), (False, 0.1, "shape"),
                                                  (True, 0.1, "adamw_rms")])
def test_a_muon_step_is_the_reference_step(nesterov, decay, scale):
    w0 = random_matrix(48, 24, seed=3) * 0.1
    grads = [random_matrix(48, 24, seed=10 + i) for i in range(3)]
    p = nn.Parameter(w0.clone())
    cfg = MuonConfig(lr=0.02, momentum=0.9, nesterov=nesterov, ns_dtype="fp32", weight_decay=decay, scale=scale)
    opt = Muon([{"kind": "muon", "params": [p], "lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                 "ns_steps": 5, "coefficients": "jordan", "ns_dtype": "fp32", "weight_decay": decay, "scale": scale}])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = reference_muon_steps(w0.double(), [g.double() for g in grads], 0.02, 0.9, nesterov, decay, scale)
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-6)


def test_a_bf16_muon_step_matches_torch_optim_muon():
    w0 = random_matrix(64, 32, seed=4) * 0.1
    grads = [random_matrix(64, 32, seed=20 + i) for i in range(3)]
    ours, torchs = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt = Muon([{"kind": "muon", "params": [ours], "lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
                 "coefficients": "jordan", "ns_dtype": "bf16", "weight_decay": 0.1, "scale": "adamw_rms"}])
    ref = torch.optim.Muon([torchs], lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1,
                           adjust_lr_fn="match_rms_adamw")
    for g in grads:
        ours.grad, torchs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, torchs)


def test_muons_adamw_groups_step_exactly_as_torchs_adamw():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 6), nn.Linear(8, 6)
    b.load_state_dict(a.state_dict())
    def groups(m):
        return [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]
    ours = Muon([{**g, "kind": "adamw", "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8} for g in groups(a)], fused=True)
    ref = torch.optim.AdamW(groups(b), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        for m, opt in ((a, ours), (b, ref)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


# ---- which parameters Muon trains, for every family

SHAPES = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=32)


def block_linear_weights(model: nn.Module) -> set[str]:
    """The blocks' matrices: every nn.Linear's weight, and a routed FFN's router and stacked experts (model.moe)."""
    return {f"layers.{i}.{name}.weight" for i, block in enumerate(model.layers)
            for name, m in block.named_modules() if isinstance(m, nn.Linear)} | {
        f"layers.{i}.{name}" for i, block in enumerate(model.layers) for name, _ in block.named_parameters()
        if name.startswith("mlp.router.") or name.startswith("mlp.experts.")}


def split(model: nn.Module, cfg: TrainConfig) -> tuple[set[str], set[str]]:
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {kind: {names[id(p)] for g in opt.param_groups if g["kind"] == kind for p in g["params"]}
             for kind in ("muon", "adamw")}
    return kinds["muon"], kinds["adamw"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_muon_trains_exactly_the_blocks_matrices_and_adamw_the_rest(family):
    model = build(model_config(dict(family=family, **SHAPES)))
    muon, adamw = split(model, TrainConfig(optimizer="muon"))
    every = {n for n, _ in model.named_parameters()}
    assert muon == block_linear_weights(model) and muon
    assert adamw == every - muon and not muon & adamw
    assert "embed.weight" in adamw and any("norm" in n for n in adamw)
    assert {n for n in every if n.startswith("lm_head") or n.startswith("pos_embed") or n.endswith("bias")} <= adamw


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_with_lora_muon_trains_the_adapters_matrices(family):
    model = build(model_config(dict(family=family, **SHAPES)))
    apply_lora(model, LoraConfig(r=4, alpha=8, use_dora=True))
    muon, adamw = split(model, TrainConfig(optimizer="muon"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert muon and all(n.endswith(("lora_A.weight", "lora_B.weight", "lora_A", "lora_B")) for n in muon)
    assert adamw == trainable - muon and all("magnitude" in n for n in adamw)  # DoRA's magnitudes are vectors


def test_muon_on_a_model_without_hidden_matrices_names_the_key():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    with pytest.raises(ConfigError, match=r"train.optimizer = muon: .*no trainable 2-D matrix"):
        build_optimizer(model, TrainConfig(optimizer="muon"))


def test_muon_keeps_adamws_decay_rule_for_what_it_leaves_to_adamw():
    model = build(model_config(dict(family="llama", **SHAPES)))
    opt = build_optimizer(model, TrainConfig(optimizer="muon", weight_decay=0.1, lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)]: (g["kind"], g["weight_decay"], g["peak_lr"]) for g in opt.param_groups for p in g["params"]}
    assert decay["lm_head.weight"] == ("adamw", 0.1, 1e-3) and decay["embed.weight"] == ("adamw", 0.0, 1e-3)
    assert decay["layers.0.attn.wq.weight"] == ("muon", 0.0, 0.02)
    assert {d for n, d in decay.items() if "norm" in n} == {("adamw", 0.0, 1e-3)}


# ---- LAMB


def reference_lamb_steps(w: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float],
                         eps: float, decay: float, bias_correction: bool, max_weight_norm: float | None,
                         max_trust_ratio: float | None) -> torch.Tensor:
    """You et al. 2019, Algorithm 2, for one tensor, in float64."""
    b1, b2 = betas
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        mh, vh = (m / (1 - b1 ** t), v / (1 - b2 ** t)) if bias_correction else (m, v)
        r = mh / (vh.sqrt() + eps) + decay * w
        phi = w.norm().item() if max_weight_norm is None else min(w.norm().item(), max_weight_norm)
        ratio = phi / r.norm().item() if phi > 0 and r.norm().item() > 0 else 1.0
        if max_trust_ratio is not None:
            ratio = min(ratio, max_trust_ratio)
        w = w - lr * ratio * r
    return w


@pytest.mark.parametrize("bias_correction,max_weight_norm,max_trust_ratio,decay",
                         [(True, None, None, 0.01), (False, 10.0, None, 0.0), (True, 0.5, None, 0.01),
                          (True, None, 1.0, 0.01)])
def test_a_lamb_step_is_the_papers_step(bias_correction, max_weight_norm, max_trust_ratio, decay):
    w0 = random_matrix(6, 5, seed=5, dtype=torch.float64)
    grads = [random_matrix(6, 5, seed=30 + i, dtype=torch.float64) for i in range(4)]
    p = nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=decay, bias_correction=bias_correction,
               max_weight_norm=max_weight_norm, max_trust_ratio=max_trust_ratio)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = reference_lamb_steps(w0, grads, 0.1, (0.9, 0.99), 1e-6, decay, bias_correction, max_weight_norm,
                               max_trust_ratio)
    torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-6)


def test_lamb_without_bias_correction_is_torch_optimizers_lamb():
    torch_optimizer = pytest.importorskip("torch_optimizer")
    torch.manual_seed(0)
    a, b = nn.Linear(16, 8), nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    ours = Lamb(a.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=False,
                max_weight_norm=10.0)
    ref = torch_optimizer.Lamb(b.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                               clamp_value=10.0, debias=False)
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        for m, opt in ((a, ours), (b, ref)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=1e-6)


def test_a_zero_tensor_takes_the_plain_adam_step():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # ‖w‖ = 0: the trust ratio is 1
    opt = Lamb([p], lr=0.1, eps=0.0)
    p.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.1, 0.1, -0.1], dtype=torch.float64))


def test_lamb_groups_follow_adamws_decay_rule():
    model = build(model_config(dict(family="llama", **SHAPES)))
    opt = build_optimizer(model, TrainConfig(optimizer="lamb", weight_decay=0.1))
    assert isinstance(opt, Lamb)
    expected = param_groups(model, 0.1)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in g["params"]] for g in expected]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# ---- bad keys: one line naming the key


@pytest.mark.parametrize("override,match", [
    ("train.lamb.max_trust_ratio=0", r"'train.lamb.max_trust_ratio' = 0: must be > 0"),
    ("train.lamb.max_weight_norm=-1", r"'train.lamb.max_weight_norm' = -1: must be > 0"),
    ("train.muon.momentum=1.0", r"'train.muon.momentum' = 1(.0)?: must be in \[0, 1\)"),
    ("train.optimizer=sgd", r"train.optimizer"),
])
def test_bad_optimizer_keys_are_one_line_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PretrainRecipe, None, [override])


def test_polar_express_has_coefficients_for_five_steps():
    with pytest.raises(ConfigError, match=r"train.muon.ns_steps = 7: polar_express"):
        load_config(PretrainRecipe, None, ["train.muon.coefficients=polar_express", "train.muon.ns_steps=7"])


# ---- whole runs


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize("optimizer,overrides", [
    ("muon", {"train.muon.lr": 0.02}),
    ("lamb", {"train.lr": 0.3}),  # LAMB moves each tensor by about lr of its norm a step
])
def test_each_optimizer_trains_and_resumes_exactly(make_recipe, tmp_path, optimizer, overrides):
    keys = {"train.optimizer": optimizer, "train.max_steps": 8, **overrides}
    run_pretrain(make_recipe(tmp_path / "full", **keys))
    full = losses(tmp_path / "full")
    assert full[-1] < full[0]
    run_pretrain(make_recipe(tmp_path / "half", **keys, **{"train.stop_at_step": 4}))
    summary = run_pretrain(make_recipe(tmp_path / "half", **keys))
    assert summary["start_step"] == 4
    assert losses(tmp_path / "half") == full  # bit-identical: the optimizer's state was saved and restored
