"""Our Transformer computes what transformers' Llama / Qwen2 / Qwen3 classes compute, and the
config and name conversions between the two round-trip."""

from __future__ import annotations

import math
import os

import pytest
import torch

from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.families import build
from lmforge.model.hf import (
    from_hf_name,
    hf_config_dict,
    model_config_from_hf,
    state_dict_from_hf,
    state_dict_to_hf,
    to_hf_name,
)
from lmforge.model.transformer import Transformer, rope_tables

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

TINY = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64, rope_theta=50000.0)


def randomized(cfg: ModelConfig, seed: int = 0, matrix_std: float | None = None) -> Transformer:
    """A model whose norm gains and biases are random too, so a mis-mapped one changes the logits;
    with ``matrix_std``, the matrices are drawn from N(0, matrix_std²) instead of the model's init."""
    torch.manual_seed(seed)
    model = build(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
            elif matrix_std is not None:
                p.normal_(0.0, matrix_std)
    return model.eval()


def hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The transformers model that ``hf_config_dict`` names, holding ``state`` (our names)."""
    config = transformers.AutoConfig.for_model(**hf_config_dict(cfg))
    config._attn_implementation = "eager"  # the plain math reference
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(state_dict_to_hf(state, cfg), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


def assert_same_logits(ours: Transformer, theirs: torch.nn.Module, vocab_size: int) -> None:
    tokens = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_llama_for_causal_lm(n_kv_heads, tie):
    cfg = ModelConfig(**TINY, n_kv_heads=n_kv_heads, tie_embeddings=tie)
    ours = randomized(cfg)
    theirs = hf_model(cfg, ours.state_dict())
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert_same_logits(ours, theirs, cfg.vocab_size)


@pytest.mark.parametrize(
    "fields, architecture",
    [
        (dict(n_kv_heads=2, qkv_bias=True, out_bias=True, mlp_bias=True), "LlamaForCausalLM"),
        (dict(n_kv_heads=2, qkv_bias=True, tie_embeddings=False), "Qwen2ForCausalLM"),
        (dict(n_kv_heads=2, qkv_bias=True, tie_embeddings=True), "Qwen2ForCausalLM"),
        (dict(n_kv_heads=2, head_dim=32, qk_norm=True), "Qwen3ForCausalLM"),
    ],
    ids=["llama-biases", "qwen2-untied", "qwen2-tied", "qwen3-qk-norm"],
)
def test_logits_match_the_hf_architecture_for_the_variant(fields, architecture):
    cfg = ModelConfig(**TINY, **fields)
    ours = randomized(cfg)
    theirs = hf_model(cfg, ours.state_dict())
    assert type(theirs).__name__ == architecture
    assert_same_logits(ours, theirs, cfg.vocab_size)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_state_dict_names_round_trip(tie):
    cfg = ModelConfig(**TINY, n_kv_heads=2, qkv_bias=True, out_bias=True, mlp_bias=True, qk_norm=True, tie_embeddings=tie)
    state = Transformer(cfg).state_dict()
    for name in state:
        assert from_hf_name(to_hf_name(name)) == name
    hf_state = state_dict_to_hf(state, cfg)
    assert ("lm_head.weight" in hf_state) == (not tie)  # a tied matrix is stored once, as HF does
    back = state_dict_from_hf(hf_state, cfg)
    assert back.keys() == state.keys()
    assert all(back[k] is state[k] or torch.equal(back[k], state[k]) for k in state)


def test_hf_names_match_transformers_parameter_names():
    cfg = ModelConfig(**TINY, n_kv_heads=2)
    ours = {to_hf_name(k) for k in Transformer(cfg).state_dict()}
    config = transformers.AutoConfig.for_model(**hf_config_dict(cfg))
    theirs = set(transformers.AutoModelForCausalLM.from_config(config).state_dict())
    assert ours == theirs


def test_unknown_names_raise_key_error():
    with pytest.raises(KeyError, match="model.vision_tower"):
        from_hf_name("model.vision_tower.weight")
    with pytest.raises(KeyError):
        from_hf_name("model.layers.0.self_attn.rotary.weight")
    with pytest.raises(KeyError):
        to_hf_name("layers.0.attn.wqkv.weight")


@pytest.mark.parametrize(
    "fields",
    [
        dict(n_kv_heads=2, tie_embeddings=True),
        dict(qkv_bias=True),
        dict(qk_norm=True, head_dim=32),
        dict(qkv_bias=True, out_bias=True, mlp_bias=True),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=16),
    ],
    ids=["llama", "qwen2", "qwen3", "llama-biases", "llama3-rope"],
)
def test_config_round_trips_through_config_json(fields):
    cfg = ModelConfig(**TINY, **fields)
    assert model_config_from_hf(hf_config_dict(cfg)) == cfg


def test_config_from_transformers_defaults_matches_their_model():
    """A config.json as transformers writes it (rope_parameters, no head_dim) reads back right."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rope_theta=123.0, rms_norm_eps=1e-6, max_position_embeddings=128,
    ).to_dict()
    config.pop("head_dim", None)
    cfg = model_config_from_hf(config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden) == (64, 4, 1, 16, 96)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len) == (123.0, 1e-6, 128)


def test_export_of_layernorm_gelu_model_is_refused():
    with pytest.raises(ValueError, match="layernorm"):
        hf_config_dict(ModelConfig(**TINY, norm="layernorm", ffn="gelu"))


def test_export_of_bias_mix_without_hf_class_is_refused():
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        hf_config_dict(ModelConfig(**TINY, out_bias=True))


def _llama_json(**extra) -> dict:
    cfg = hf_config_dict(ModelConfig(**TINY))
    return {**cfg, **extra}


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(model_type="bloom", architectures=["BloomForCausalLM"]), "model_type 'bloom'.*LlamaForCausalLM"),
        (dict(architectures=["LlamaForSequenceClassification"]), "architectures"),
        (dict(hidden_act="gelu"), "hidden_act = .gelu. is not supported.*\"silu\" or \"swish\""),
        (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 5e5}),
         "RoPE scaling 'proportional' is not supported; lmforge implements rope_type 'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'"),
        (dict(rope_parameters=None, rope_scaling={"type": "su", "factor": 2.0}), "RoPE scaling 'su' is not supported"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "'llama3' needs low_freq_factor, high_freq_factor"),
        (dict(rope_scaling={"rope_type": "linear"}), "'linear' needs factor"),
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantized"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5 is not supported"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), "partial_rotary_factor 0.5"),
    ],
    ids=["arch", "head", "act", "rope-unknown", "rope-su", "rope-llama3-incomplete", "rope-linear-incomplete", "quantized", "partial-rope",
         "partial-rope-in-rope-parameters"],
)
def test_unsupported_configs_raise_input_error(extra, message):
    with pytest.raises(InputError, match=message):
        model_config_from_hf(_llama_json(**extra), where="somewhere/config.json")


def test_sliding_window_is_read_as_transformers_reads_it():
    mistral = {**_llama_json(model_type="mistral", architectures=["MistralForCausalLM"]), "sliding_window": 16}
    cfg = model_config_from_hf(mistral)
    assert (cfg.max_seq_len, cfg.sliding_window, cfg.sliding_layers()) == (64, 16, (True, True))
    assert model_config_from_hf({**mistral, "sliding_window": None}).sliding_window is None
    assert model_config_from_hf({**mistral, "sliding_window": 4096}).sliding_window is None  # longer than the context
    qwen2 = {**_llama_json(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "sliding_window": 16}
    assert model_config_from_hf({**qwen2, "use_sliding_window": False}).sliding_window is None
    # transformers: layers from max_window_layers on are sliding (its default 28 leaves both of these full)
    assert model_config_from_hf({**qwen2, "use_sliding_window": True}).sliding_window is None
    assert model_config_from_hf({**qwen2, "use_sliding_window": True, "max_window_layers": 1}).sliding_layers() == (False, True)
    assert model_config_from_hf({**qwen2, "use_sliding_window": True, "max_window_layers": 0}).layer_types is None
    both = {**qwen2, "use_sliding_window": True, "max_window_layers": 0, "layer_types": ["sliding_attention", "full_attention"]}
    assert model_config_from_hf(both).sliding_layers() == (True, False)  # layer_types wins, as in transformers
    with pytest.raises(InputError, match=r"config.json: layer_types has 3 entries; it needs one per layer, n_layers = 2"):
        model_config_from_hf({**both, "layer_types": ["sliding_attention"] * 3})


# --------------------------------------------------------------------------- Llama 3.1 RoPE scaling

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# head_dim 16, theta 5e4: RoPE wavelengths 6.3, 24, 94, ... tokens, so with an original context of 64
# the pairs fall in all three bands (kept < 16 <= smoothed <= 64 < divided by the factor).
SCALED = dict(
    TINY, max_seq_len=256, n_kv_heads=2,
    rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=64,
)


def test_llama3_rope_scaling_changes_the_tables_in_all_three_bands():
    scaled, plain = ModelConfig(**SCALED), ModelConfig(**{**SCALED, "rope_scaling": "none", "rope_factor": 1.0, "rope_original_max_seq_len": None})
    (cos, sin), (cos0, sin0) = rope_tables(scaled), rope_tables(plain)
    inv_freq, inv_freq0 = torch.atan2(sin[1], cos[1]), torch.atan2(sin0[1], cos0[1])  # the angle at position 1
    ratio = inv_freq / inv_freq0
    assert ratio[0] == 1.0  # wavelength 6.3 < 64 / 4: kept
    # wavelength 24, between the bands: inv_freq * ((1 - s) / factor + s) with s = (64 / wavelength - 1) / (4 - 1)
    smooth = (64 / (2 * math.pi / inv_freq0[1]) - 1.0) / (4.0 - 1.0)
    torch.testing.assert_close(ratio[1], (1 - smooth) / 8 + smooth)
    assert not torch.isclose(ratio[1], torch.tensor(1.0)) and not torch.isclose(ratio[1], torch.tensor(1 / 8))
    torch.testing.assert_close(ratio[2:], torch.full_like(ratio[2:], 1 / 8))  # wavelength > 64: divided by 8
    assert not torch.allclose(cos, cos0)


def test_logits_match_llama_for_causal_lm_with_llama3_rope_scaling():
    cfg = ModelConfig(**SCALED)
    ours = randomized(cfg)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(LLAMA3_ROPE), attn_implementation="eager",
    )
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)
        # the check can fail: the same weights without the scaling compute something else
        plain = randomized(ModelConfig(**{**SCALED, "rope_scaling": "none", "rope_factor": 1.0, "rope_original_max_seq_len": None}))
        assert (plain(tokens) - theirs(tokens).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    "config",
    [
        # transformers >= 5 writes rope_parameters
        lambda: transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rope_theta=50000.0, rope_scaling=dict(LLAMA3_ROPE),
        ).to_dict(),
        # Meta's Llama-3.x config.json (transformers < 5): rope_scaling beside a top-level rope_theta
        lambda: {**_llama_json(max_position_embeddings=256, rope_theta=50000.0, rope_scaling=dict(LLAMA3_ROPE)), "rope_parameters": None},
    ],
    ids=["rope_parameters", "rope_scaling"],
)
def test_llama3_rope_scaling_is_read_from_either_spelling(config):
    cfg = model_config_from_hf(config())
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_factor) == ("llama3", 50000.0, 8.0)
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len) == (1.0, 4.0, 64)


def test_llama3_rope_scaling_is_written_for_both_transformers_generations():
    config = hf_config_dict(ModelConfig(**SCALED))
    assert config["rope_scaling"] == LLAMA3_ROPE
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 50000.0}
    assert "rope_scaling" not in hf_config_dict(ModelConfig(**TINY))


@torch.no_grad()
def test_cached_decoding_of_a_scaled_model_gives_the_logits_of_a_full_recompute():
    """The engine's decoding layout reads the model's RoPE tables, so the scaling reaches it."""
    from lmforge.inference.engine import GenerationConfig, decode_step, decoding_view, generate, prefill

    model = randomized(ModelConfig(**SCALED))
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 90)]
    net = decoding_view(model)
    assert net is not model  # the fused layout, not the modules
    batch = prefill(net, prompts, extra=8)
    seqs = [list(p) for p in prompts]
    for _ in range(8):
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(batch.logits[row], model(torch.tensor([seq]))[0, -1], atol=1e-5, rtol=0)
        next_tokens = batch.logits.argmax(-1)
        for seq, token in zip(seqs, next_tokens.tolist()):
            seq.append(token)
        decode_step(net, next_tokens, batch)
    out = generate(model, prompts, GenerationConfig(max_new_tokens=8, temperature=0.0, stop_token_ids=[]))
    assert [g.tokens for g in out] == [seq[len(p):] for seq, p in zip(seqs, prompts)]
