"""Sliding-window attention: transformers' window (a query sees ``sliding_window`` positions,
itself included) on the layers ``layer_types`` names, in a full forward and in cached decoding
(a ring of ``sliding_window`` slots when every layer slides), Mistral and Qwen2 windows imported
and exported with transformers' logits, and one-line errors for a bad window."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from lmforge.inference.engine import decode_step, decoding_view, prefill
from lmforge.model.config import ModelConfig
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_from_hf, state_dict_to_hf
from lmforge.model.transformer import Transformer
from tests.model.test_hf import randomized

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (the reference)

WINDOW = 16
HF_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-5)
HF_WINDOWS = {  # (config class, its window keys, the layers lmforge must window)
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW), (True, True)),
    "qwen2-max-window-layers": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                               max_window_layers=1), (False, True)),
    "qwen2-layer-types": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                         layer_types=["sliding_attention", "full_attention"]), (True, False)),
    "qwen2-every-layer": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=0), (True, True)),
}


def random_hf(kind: str) -> torch.nn.Module:
    cls, window, _ = HF_WINDOWS[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**HF_COMMON, **window), attn_implementation="eager")
    with torch.no_grad():  # random norm gains and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    return model.eval()


def tokens(length: int = 48, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, HF_COMMON["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(3))


def cached_logits(model: Transformer, x: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """Logits of ``x`` fed through a KV cache in chunks of ``steps`` tokens, then one token a step."""
    cache = model.new_kv_cache(x.shape[0], x.shape[1], torch.float32, "cpu")
    out, at = [], 0
    for n in steps + [1] * (x.shape[1] - sum(steps)):
        out.append(model(x[:, at : at + n], kv_cache=cache))
        at += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", list(HF_WINDOWS))
def test_an_imported_window_gives_transformers_logits_in_a_forward_and_in_cached_decoding(kind):
    theirs = random_hf(kind)
    cfg = model_config_from_hf(theirs.config.to_dict())
    assert (cfg.sliding_window, cfg.sliding_layers()) == (WINDOW, HF_WINDOWS[kind][2])
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict(), cfg))
    x = tokens()  # 48 tokens, three windows
    with torch.no_grad():
        expected = theirs(x).logits
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        # without the window the same weights are far from transformers' past the window: the test can fail
        blind = Transformer(dataclasses.replace(cfg, sliding_window=None, layer_types=None)).eval()
        blind.load_state_dict(ours.state_dict())
        assert (blind(x) - expected)[:, WINDOW:].abs().max() > 1e-2
        # cached decoding: a prefill shorter than, then one longer than the window; chunks after a prefix
        for steps in ([5], [40], [5, 25, 3]):
            torch.testing.assert_close(cached_logits(ours, x, steps), expected, atol=1e-5, rtol=0)
        # the engine's left-padded prefill of prompts around the window, then one token a step on its decoding layout
        prompts = [x[0, :20].tolist(), x[1, :7].tolist()]
        net = decoding_view(ours)
        batch = prefill(net, prompts, extra=28)
        for step in range(28):
            for row, prompt in enumerate(prompts):
                torch.testing.assert_close(batch.logits[row], expected[row, len(prompt) - 1 + step], atol=1e-5, rtol=0)
            decode_step(net, torch.stack([x[row, len(p) + step] for row, p in enumerate(prompts)]), batch)


@pytest.mark.parametrize("fields, architecture", [
    (dict(sliding_window=WINDOW), "MistralForCausalLM"),
    (dict(sliding_window=WINDOW, qkv_bias=True, layer_types=["full_attention", "sliding_attention"]), "Qwen2ForCausalLM"),
    (dict(sliding_window=WINDOW, qkv_bias=True, layer_types=["sliding_attention", "full_attention"]), "Qwen2ForCausalLM"),
    (dict(sliding_window=WINDOW, qk_norm=True), "Qwen3ForCausalLM"),
])
def test_export_writes_the_window_back_and_transformers_computes_our_logits(fields, architecture):
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64,
                      rope_theta=20000.0, **fields)
    ours = randomized(cfg)
    config = hf_config_dict(cfg)
    assert config["architectures"] == [architecture] and config["sliding_window"] == WINDOW
    back = model_config_from_hf(config)
    assert (back.sliding_window, back.sliding_layers()) == (cfg.sliding_window, cfg.sliding_layers())
    hf_cfg = transformers.AutoConfig.for_model(**config)
    hf_cfg._attn_implementation = "eager"
    theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    missing, unexpected = theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg), strict=False)
    assert not missing and not unexpected
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, atol=1e-5, rtol=0)


def test_export_refuses_a_window_no_hugging_face_class_expresses():
    base = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, sliding_window=8)
    with pytest.raises(ValueError, match="mixes sliding and full layers.*Mistral"):
        hf_config_dict(ModelConfig(**base, layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="no Hugging Face architecture has a sliding window with qkv_bias=True, out_bias=True"):
        hf_config_dict(ModelConfig(**base, qkv_bias=True, out_bias=True))


@torch.no_grad()
def test_a_query_sees_the_window_itself_included_and_nothing_before():
    """One sliding layer of window W: the output at t depends on tokens t-W+1 .. t, and not on t-W."""
    W, t = 5, 12
    model = randomized(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=32, sliding_window=W))
    x = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))

    def changed_at_t(position: int) -> float:
        y = x.clone()
        y[0, position] = (y[0, position] + 1) % 64
        return float((model(y)[0, t] - model(x)[0, t]).abs().max())

    assert changed_at_t(t - W) == 0.0
    assert all(changed_at_t(p) > 1e-4 for p in range(t - W + 1, t + 1))


def test_the_cache_of_a_model_whose_every_layer_slides_is_a_ring_of_the_window():
    def cfg(**kw):
        return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, **kw)

    def capacity(c: ModelConfig, max_len: int) -> int:
        return Transformer(c).new_kv_cache(1, max_len, torch.float32, "cpu").capacity

    assert capacity(cfg(sliding_window=8), 48) == 8
    assert capacity(cfg(sliding_window=8), 5) == 5  # never more than it needs
    assert capacity(cfg(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), 48) == 48
    assert capacity(cfg(), 48) == 48


@pytest.mark.parametrize("fields, message", [
    (dict(sliding_window=65), r"sliding_window = 65 must be in \[1, max_seq_len = 64\]"),
    (dict(sliding_window=0), r"sliding_window"),
    (dict(sliding_window=8, layer_types=["sliding_attention"] * 3), r"layer_types has 3 entries; it needs one per layer, n_layers = 2"),
    (dict(layer_types=["sliding_attention", "full_attention"]), r"layer_types names 'sliding_attention' layers but sliding_window is not set"),
])
def test_a_bad_window_is_one_line_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, **fields)
    assert "\n" not in str(err.value)


def test_attention_flops_of_a_sliding_layer_count_its_window():
    full = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64)
    half = dataclasses.replace(full, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    per_layer_key = 12 * full.n_heads * full.head_dim
    assert full.flops_per_token(64) - half.flops_per_token(64) == per_layer_key * (64 - 16)
    assert full.flops_per_token(16) == half.flops_per_token(16)
