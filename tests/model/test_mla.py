"""Multi-head latent attention (``lmforge.model.mla``): the absorbed form (W_UK folded into the query,
W_UV into the output) equals the expanded one over a latent cache, prefill and decoding alike; the cache
holds only each token's latent and RoPE key, and its bytes per token are counted against MHA and GQA of
the same width; the scores' scale carries YaRN's mscale². Transformers' logits are
tests/model/families/test_deepseek_v3.py's and test_parity.py's."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model.families import build, model_config
from lmforge.model.mla import MLA, cache_bytes_per_token, latent_cache, softmax_scale
from tests.model.test_hf_fields import randomize_
from tests.model.test_parity import tolerance

MLA_SHAPE = dict(family="deepseek_v3", vocab_size=300, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, max_seq_len=64,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                 moe={"first_dense_layers": 2})  # dense: the forms' equality is the attention's alone
FORMS = {
    "q-lora": dict(q_lora_rank=24, qkv_bias=True, out_bias=True),
    "no-q-lora-halves": dict(rope_interleave=False),
    "yarn-mscale": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=16, rope_mscale=1.0,
                        rope_mscale_all_dim=0.5),
}


def random_model(**fields):
    return randomize_(build(model_config({**MLA_SHAPE, **fields})))


def set_form(model, absorb: bool | None) -> None:
    for block in model.layers:
        block.attn.absorb = absorb


def decoded_logits(model, tokens: torch.Tensor, prompt: int, absorb: bool | None) -> torch.Tensor:
    """Logits of a prefill of ``prompt`` tokens into the model's latent cache, a step of 3 tokens after it
    (masked causally behind the cached ones), then one token a step."""
    set_form(model, absorb)
    cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1], torch.float32, "cpu")
    with torch.no_grad():
        steps = [model(tokens[:, :prompt], kv_cache=cache), model(tokens[:, prompt : prompt + 3], kv_cache=cache)]
        steps += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(prompt + 3, tokens.shape[1])]
    set_form(model, None)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("form", list(FORMS))
def test_absorbed_and_expanded_forms_give_equal_logits_on_prefill_and_decoding(form):
    model = random_model(**FORMS[form])
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
    atol = tolerance(torch.float32, 2, float(full.abs().max()))
    absorbed = decoded_logits(model, tokens, 12, absorb=True)  # the prefill absorbed too
    expanded = decoded_logits(model, tokens, 12, absorb=False)
    default = decoded_logits(model, tokens, 12, absorb=None)  # prefill expanded, steps absorbed
    torch.testing.assert_close(absorbed, expanded, atol=atol, rtol=0)
    torch.testing.assert_close(default, full, atol=atol, rtol=0)
    torch.testing.assert_close(expanded, full, atol=atol, rtol=0)
    assert (absorbed - expanded).abs().max() > 0  # two orders of the arithmetic, not one path run twice


@torch.no_grad()
def test_a_decoding_step_attends_in_the_absorbed_form_without_expanding_the_cache(monkeypatch):
    model = random_model()
    tokens = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = model.new_kv_cache(1, 6, torch.float32, "cpu")
    model(tokens[:, :5], kv_cache=cache)
    widths = []
    wkv_b = model.layers[0].attn.wkv_b
    monkeypatch.setattr(wkv_b, "forward", lambda x: widths.append(x.shape) or torch.nn.Linear.forward(wkv_b, x))
    model(tokens[:, 5:], kv_cache=cache)
    assert widths == []  # no latent expanded into per-head keys and values
    model(tokens)  # the training forward expands every position
    assert widths == [torch.Size([1, 1, 6, 32])]


def test_the_cache_holds_the_latent_and_the_rope_key_only():
    cfg = model_config({**MLA_SHAPE, "q_lora_rank": 24})
    cache = build(cfg).new_kv_cache(3, 10, torch.float32, "cpu")
    assert {name: tuple(t.shape) for name, t in cache.tensors.items()} == {"k": (2, 3, 1, 10, 32), "v": (2, 3, 1, 10, 8)}
    assert cache.bytes_per_token() == 2 * (32 + 8) * 4
    quantised = latent_cache(cfg, 3, 10, torch.float32, "cpu", "int8")
    assert quantised.bytes_per_token() == 2 * (32 + 4 + 8 + 4)  # int8 latent and key, one fp32 scale each


@pytest.mark.parametrize("element", [2, 4])
def test_cache_bytes_per_token_against_mha_and_gqa_of_the_same_width(element):
    cfg = model_config({**MLA_SHAPE, "n_heads": 8, "d_model": 128})
    dtype = {2: torch.bfloat16, 4: torch.float32}[element]
    counted = cache_bytes_per_token(cfg, element, gqa_kv_heads=2)
    assert counted["mla"] == build(cfg).new_kv_cache(1, 4, dtype, "cpu").bytes_per_token() == 2 * (32 + 8) * element
    for name, kv_heads in (("mha", 8), ("gqa", 2)):  # llama-family caches of the same width: heads of 128 / 8
        same_width = model_config({k: v for k, v in cfg.__dict__.items() if k in ("vocab_size", "d_model", "n_layers",
                                   "n_heads", "max_seq_len")} | {"n_kv_heads": kv_heads})
        assert counted[name] == build(same_width).new_kv_cache(1, 4, dtype, "cpu").bytes_per_token()
    assert counted["mha"] == 2 * 2 * 128 * element and counted["gqa"] == 2 * 2 * 2 * 16 * element  # layers, k and v, width
    assert cache_bytes_per_token(cfg, element)["gqa"] == 2 * 2 * 1 * 16 * element  # layers, k and v, n_heads / 8 = 1 head of 16


def test_the_scores_scale_carries_yarns_mscale_squared():
    plain = model_config(MLA_SHAPE)
    assert softmax_scale(plain) == 24**-0.5
    yarn = model_config({**MLA_SHAPE, **FORMS["yarn-mscale"]})
    assert softmax_scale(yarn) == pytest.approx(24**-0.5 * (0.1 * 0.5 * math.log(4.0) + 1) ** 2, rel=1e-12)
    no_mscale = model_config({**MLA_SHAPE, "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 16})
    assert softmax_scale(no_mscale) == 24**-0.5  # YaRN's own temperature is in its cos and sin
    assert MLA(yarn, 0).scale == softmax_scale(yarn)
