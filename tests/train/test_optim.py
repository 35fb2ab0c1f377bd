import pytest
import torch

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.optim import build_adamw, lr_at, param_groups


def test_weight_decay_applies_to_matrices_only():
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, ffn_hidden=32,
                                    qkv_bias=True, tie_embeddings=True, max_seq_len=16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attn.wq.weight" in decayed and "layers.1.mlp.w2.weight" in decayed
    assert not any(n.endswith("bias") or "norm" in n or n == "embed.weight" for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_defaults_match_the_issue():
    model = torch.nn.Linear(4, 4)
    opt = build_adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_cosine_warms_up_linearly_and_ends_at_ten_percent():
    kw = dict(peak=1.0, max_steps=100, warmup_steps=10, schedule="cosine")
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(55, **kw) == pytest.approx(0.55)  # halfway through the decay
    assert lr_at(100, **kw) == pytest.approx(0.1) and lr_at(99, **kw) > 0.1


def test_wsd_holds_then_decays_over_the_last_fraction():
    kw = dict(peak=1.0, max_steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, **kw) == 1.0 and lr_at(79, **kw) == 1.0
    assert lr_at(90, **kw) == pytest.approx(0.55) and lr_at(100, **kw) == pytest.approx(0.1)


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(50, peak=1.0, max_steps=100, warmup_steps=0, schedule="linear")
