"""RoPE scaling (``model.rope``) computes what transformers' ``ROPE_INIT_FUNCTIONS`` and its
Llama model compute: the frequencies and attention factor of every type and key, the logits of
a training forward and of cached decoding past the original context, and the config.json keys
both ways; a config it cannot honour is one line naming the key."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from lmforge.core.io import InputError
from lmforge.model.config import ROPE_SCALING_FIELDS, ModelConfig
from lmforge.model.hf import hf_config_dict, model_config_from_hf, read_hf_weights, state_dict_from_hf, state_dict_to_hf
from lmforge.model.rope import LENGTH_DEPENDENT, ROPE_FREQUENCIES, rope_tables
from lmforge.model.transformer import Transformer
from tests.model.test_hf import randomized

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (the reference)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# head_dim 16, theta 5e4, original context 64: RoPE wavelengths 6.3 .. 5e4 tokens, so every
# type's bands and ramps fall inside the head (YaRN's ramp covers pairs 0-2, Llama 3.1's three bands)
SMALL = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256, rope_theta=50000.0)
SHORT = [1.0 + 0.1 * i for i in range(8)]
LONG = [1.0 + 0.9 * i**1.5 for i in range(8)]
SCALINGS = {
    "linear": dict(rope_scaling="linear", rope_factor=3.0),
    "dynamic": dict(rope_scaling="dynamic", rope_factor=4.0, rope_original_max_seq_len=64),
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64),
    # head_dim 32, original context 128: the ramp's ends (beta_fast 2, beta_slow 0.75) fall at pairs 3.4 and 4.9
    "yarn-keys": dict(rope_scaling="yarn", head_dim=32, rope_factor=8.0, rope_original_max_seq_len=128, rope_beta_fast=2.0,
                      rope_beta_slow=0.75, rope_mscale=0.707, rope_mscale_all_dim=1.0, rope_truncate=False),
    "yarn-attention-factor": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64, rope_attention_factor=1.3),
    "longrope": dict(rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=64, rope_short_factor=SHORT, rope_long_factor=LONG),
    "longrope-attention-factor": dict(rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=64, rope_short_factor=SHORT,
                                      rope_long_factor=LONG, rope_attention_factor=1.1),
    "llama3": dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0, rope_original_max_seq_len=64),
}


def hf_config(cfg: ModelConfig) -> transformers.PretrainedConfig:
    config = transformers.AutoConfig.for_model(**hf_config_dict(cfg))
    config._attn_implementation = "eager"
    return config


def their_frequencies(config: transformers.PretrainedConfig, seq_len=None) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)


def assert_same_frequencies(cfg: ModelConfig, config: transformers.PretrainedConfig, seq_len=None) -> None:
    ours, our_factor = ROPE_FREQUENCIES[cfg.rope_scaling](cfg, None, seq_len=seq_len)
    theirs, their_factor = their_frequencies(config, seq_len)
    torch.testing.assert_close(ours, theirs.expand_as(ours), atol=1e-6, rtol=0)
    assert our_factor == pytest.approx(their_factor, abs=1e-6)


# --------------------------------------------------------------------------- frequencies


@pytest.mark.parametrize("seq_len", [None, 40, 65, 200], ids=["init", "within", "just-past", "far-past"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(scaling, seq_len):
    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    assert_same_frequencies(cfg, hf_config(cfg), seq_len)


@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
def test_length_dependent_frequencies_per_row_equal_transformers_for_each_length(scaling):
    """A (B,) tensor of lengths gives each row the set transformers computes for that length
    (its dynamic update passes the length as a tensor)."""
    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    lengths = torch.tensor([30, 64, 65, 130, 256])
    ours, _ = ROPE_FREQUENCIES[scaling](cfg, None, seq_len=lengths)
    assert ours.shape == (5, 8)
    for row, length in enumerate(lengths):
        theirs, _ = their_frequencies(hf_config(cfg), length if length > 64 else None)
        torch.testing.assert_close(ours[row], theirs, atol=1e-6, rtol=0)
    assert not torch.allclose(ours[1], ours[2])  # past the original context the set changes


def test_every_key_a_type_reads_changes_its_frequencies_or_attention_factor():
    """So a key dropped on the way (config, import, export) cannot pass the equality tests unseen."""
    changed = {"rope_factor": 6.0, "rope_low_freq_factor": 1.5, "rope_high_freq_factor": 6.0, "rope_original_max_seq_len": 100,
               "rope_beta_fast": 4.0, "rope_beta_slow": 0.5, "rope_mscale": 2.0, "rope_mscale_all_dim": 0.5,
               "rope_attention_factor": 1.7, "rope_short_factor": LONG, "rope_long_factor": SHORT}
    bases = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn-keys", "longrope": "longrope", "llama3": "llama3"}
    for rope_type, base in bases.items():
        for key in ROPE_SCALING_FIELDS[rope_type]:
            before = ModelConfig(**SMALL, **SCALINGS[base])
            after = ModelConfig(**{**SMALL, **SCALINGS[base], key: changed.get(key, not getattr(before, key))})
            seq_len = torch.tensor([50, 200])  # both sides of either original context
            f0, a0 = ROPE_FREQUENCIES[rope_type](before, None, seq_len=seq_len)
            f1, a1 = ROPE_FREQUENCIES[rope_type](after, None, seq_len=seq_len)
            assert a0 != a1 or not torch.allclose(f0, f1), f"{rope_type}: {key} changes nothing"


def test_tables_carry_the_attention_factor_as_transformers_scales_cos_and_sin():
    cfg = ModelConfig(**SMALL, **SCALINGS["yarn-keys"])
    rotary = transformers.LlamaForCausalLM(hf_config(cfg)).model.rotary_emb
    positions = torch.arange(cfg.max_seq_len)[None]
    their_cos, their_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(cfg)
    torch.testing.assert_close(torch.cat((cos, cos), -1), their_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), their_sin[0], atol=1e-6, rtol=0)
    assert rotary.attention_scaling != 1.0 and cos[0, 0] == pytest.approx(rotary.attention_scaling)


# --------------------------------------------------------------------------- import: keys resolved as transformers resolves them


def llama_config(**fields) -> transformers.LlamaConfig:
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0)
    return transformers.LlamaConfig(**{**common, **fields})


def llama_dict(**fields) -> dict:
    return llama_config(**fields).to_dict()


@pytest.mark.parametrize(
    "fields",
    [
        dict(rope_scaling={"type": "linear", "factor": 2.0}),
        dict(rope_scaling={"rope_type": "dynamic", "factor": 3.0}),
        # factor omitted: the ratio of max_position_embeddings to the original context; beta_fast 0 reads as 32
        dict(rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64, "beta_fast": 0}),
        # mscale alone is ignored (transformers needs both); truncate off; the original context at the top level wins
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.8,
                           "truncate": False, "beta_slow": 2}, original_max_position_embeddings=24),
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.8,
                           "mscale_all_dim": 0.5, "attention_factor": 1.25}),
        # Phi-3's spelling: the original context at the top level, no factor
        dict(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG}, original_max_position_embeddings=32),
        dict(rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 2.0,
                           "original_max_position_embeddings": 64, "attention_factor": 0.9}),
    ],
    ids=["linear", "dynamic", "yarn-implicit-factor", "yarn-top-level-original", "yarn-mscale-pair", "longrope-phi3", "longrope-keys"],
)
def test_imported_keys_give_transformers_frequencies(fields):
    theirs = llama_config(**fields)
    cfg = model_config_from_hf(theirs.to_dict())
    for seq_len in (None, 100, 300):
        assert_same_frequencies(cfg, theirs, seq_len)


def test_the_top_level_original_context_is_the_one_transformers_reads():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    top = model_config_from_hf(llama_dict(rope_scaling=dict(rope), original_max_position_embeddings=24))
    inner = model_config_from_hf(llama_dict(rope_scaling=dict(rope)))
    assert (top.rope_original_max_seq_len, inner.rope_original_max_seq_len) == (24, 64)
    assert not torch.allclose(ROPE_FREQUENCIES["yarn"](top)[0], ROPE_FREQUENCIES["yarn"](inner)[0])


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_config_round_trips_through_config_json(scaling):
    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    config = hf_config_dict(cfg)
    assert config["rope_scaling"]["rope_type"] == cfg.rope_scaling
    assert config["rope_parameters"] == {**config["rope_scaling"], "rope_theta": cfg.rope_theta}
    assert model_config_from_hf(json.loads(json.dumps(config))) == cfg


def test_dynamic_ntk_exports_its_original_context_as_max_position_embeddings():
    """transformers' dynamic NTK grows the base past max_position_embeddings; lmforge's context is factor times it."""
    cfg = ModelConfig(**SMALL, **SCALINGS["dynamic"])
    assert hf_config_dict(cfg)["max_position_embeddings"] == 64
    assert model_config_from_hf(llama_dict(max_position_embeddings=100, rope_scaling={"rope_type": "dynamic", "factor": 2.5})).max_seq_len == 250


# --------------------------------------------------------------------------- logits


def write_hf_folder(path, cfg: ModelConfig, model: Transformer) -> None:
    """What ``lmforge export`` writes: config.json and model.safetensors under HF names."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    save_file({k: v.contiguous() for k, v in state_dict_to_hf(model.state_dict(), cfg).items()}, str(path / "model.safetensors"))


def import_hf_folder(path) -> Transformer:
    """What ``lmforge import`` reads: the folder's config.json and weights, as our model."""
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()), where=str(path / "config.json"))
    model = Transformer(cfg)
    model.load_state_dict(state_dict_from_hf(read_hf_weights(path), cfg))
    return model.eval()


@pytest.mark.parametrize("scaling", list(SCALINGS))
@torch.no_grad()
def test_export_and_import_of_each_scaling_give_llama_for_causal_lm_logits(tmp_path, scaling):
    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    ours = randomized(cfg, matrix_std=0.1)
    write_hf_folder(tmp_path / "exported", cfg, ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager").eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    theirs.save_pretrained(tmp_path / "saved")  # their folder, as transformers writes it
    back = import_hf_folder(tmp_path / "saved")
    assert back.cfg == cfg
    plain = randomized(ModelConfig(**SMALL), matrix_std=0.1)
    for T in (40, 200):  # within and far past the original context
        tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(back(tokens), expected, atol=1e-5, rtol=0)
        if T == 200 or scaling != "dynamic":  # dynamic NTK within the original context is plain RoPE
            # the check can fail: the same weights with plain RoPE compute something else
            assert (plain(tokens) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
@torch.no_grad()
def test_cached_decoding_past_the_original_context_gives_transformers_cached_logits(scaling):
    """Each step computes its frequencies from the length so far, in lmforge's engine (on its
    decoding layout) as in transformers' own cache: a prefill within the original 64 positions,
    then one token a step to 90, the cached keys keeping the rotation of their step."""
    from lmforge.inference.engine import decode_step, decoding_view, prefill

    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    ours = randomized(cfg, matrix_std=0.1)
    theirs = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (1, 90), generator=torch.Generator().manual_seed(3))
    out = theirs(tokens[:, :50], use_cache=True)
    cache, their_logits = out.cache, [out.logits[0, -1]]
    for t in range(50, 89):
        out = theirs(tokens[:, t : t + 1], cache=cache, use_cache=True)
        their_logits.append(out.logits[0, -1])

    net = decoding_view(ours)
    batch = prefill(net, [tokens[0, :50].tolist()], extra=40)
    for step, t in enumerate(range(50, 90)):
        torch.testing.assert_close(batch.logits[0], their_logits[step], atol=1e-5, rtol=0)
        if t < 89:
            decode_step(net, tokens[0, t : t + 1], batch)
    # the check can fail: past the original context, cached decoding differs from a full recompute
    assert (ours(tokens[:, :89])[0, -1] - their_logits[-1]).abs().max() > 1e-4


@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
@torch.no_grad()
def test_a_left_padded_batch_computes_what_each_row_computes_alone(scaling):
    """Each row takes the frequencies of its own length (transformers takes the batch's longest),
    so the engine's rows stay independent of what they are batched with."""
    from lmforge.inference.engine import decode_step, decoding_view, prefill

    cfg = ModelConfig(**SMALL, **SCALINGS[scaling])
    net = decoding_view(randomized(cfg, matrix_std=0.1))
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (120, 40, 70)]
    feed = torch.randint(3, 300, (3, 30), generator=torch.Generator().manual_seed(0))
    together = prefill(net, prompts, extra=30)
    alone = [prefill(net, [p], extra=30) for p in prompts]
    for step in range(30):
        for row, single in enumerate(alone):
            torch.testing.assert_close(together.logits[row], single.logits[0], atol=1e-5, rtol=0)
            decode_step(net, feed[row, step : step + 1], single)
        decode_step(net, feed[:, step], together)


@torch.no_grad()
def test_longrope_logits_match_transformers_on_both_sides_of_the_original_context():
    """LongRoPE's home is Phi-3 (not importable yet); transformers' Llama takes its rope_scaling,
    and switches from the short to the long factors past the original context as lmforge does."""
    cfg = ModelConfig(**SMALL, **SCALINGS["longrope"])
    ours = randomized(cfg, matrix_std=0.1)
    theirs = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg))
    for T in (64, 65):
        tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)
    short = ours(tokens[:, :64])
    assert (ours(tokens)[:, :64] - short).abs().max() > 1e-4  # one more token changes every position's rotation


# --------------------------------------------------------------------------- the fixed-table path


@pytest.mark.parametrize("scaling", ["none", "linear", "yarn", "llama3", "dynamic", "longrope"])
def test_a_forward_within_the_original_context_reads_the_tables_without_computing(scaling):
    """Plain and fixed scalings (and the length-dependent ones within their original context)
    take rows of the model's tables: no RoPE arithmetic per forward."""
    fields = SCALINGS.get(scaling, {}) if scaling != "none" else {}
    model = Transformer(ModelConfig(**SMALL, **fields))
    cos, sin = model.rope_at(offset=10, T=50, positions=None)
    assert cos.data_ptr() == model.rope_cos[10].data_ptr() and sin.data_ptr() == model.rope_sin[10].data_ptr()
    if scaling in LENGTH_DEPENDENT:
        far, _ = model.rope_at(offset=0, T=100, positions=None)
        assert far.data_ptr() != model.rope_cos.data_ptr()
        assert not torch.allclose(far[0, 80], model.rope_cos[80])


# --------------------------------------------------------------------------- bad config


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rope_scaling="yarn", rope_factor=0.5, rope_original_max_seq_len=64), r"'rope_factor' = 0.5: must be >= 1"),
        (dict(rope_scaling="yarn", rope_factor=4.0), "rope_scaling yarn needs rope_original_max_seq_len"),
        (dict(rope_scaling="dynamic", rope_factor=4.0), "rope_scaling dynamic needs rope_original_max_seq_len"),
        (dict(rope_scaling="longrope", rope_original_max_seq_len=64, rope_short_factor=SHORT, rope_long_factor=LONG[:6]),
         r"rope_scaling longrope needs rope_long_factor, one factor per RoPE pair: head_dim / 2 = 8 numbers, got 6"),
        (dict(rope_scaling="longrope", rope_original_max_seq_len=64, rope_long_factor=LONG),
         r"needs rope_short_factor, one factor per RoPE pair: head_dim / 2 = 8 numbers, got none"),
        (dict(rope_scaling="longrope", rope_original_max_seq_len=64, rope_short_factor=[0.0] * 8, rope_long_factor=LONG),
         r"'rope_short_factor\[0\]' = 0: must be > 0"),
        (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64, rope_low_freq_factor=2.0),
         "rope_low_freq_factor=2.0 set but rope_scaling is 'yarn', which does not read it; set rope_scaling to llama3 or remove it"),
        (dict(rope_scaling="linear", rope_factor=2.0, rope_original_max_seq_len=64, rope_beta_fast=8.0),
         "rope_beta_fast=8.0, rope_original_max_seq_len=64 set but rope_scaling is 'linear', which does not read them; "
         "set rope_scaling to dynamic or llama3 or longrope or yarn or remove them"),
        (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=64, rope_short_factor=SHORT),
         "rope_short_factor=.* set but rope_scaling is 'llama3', which does not read it; set rope_scaling to longrope"),
        (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64, rope_mscale=0.7),
         "rope_mscale and rope_mscale_all_dim set YaRN's attention factor together; set both or neither"),
    ],
    ids=["yarn-factor-below-1", "yarn-no-original", "dynamic-no-original", "longrope-long-length", "longrope-no-short",
         "longrope-zero-factor", "llama3-key-on-yarn", "keys-on-linear", "longrope-key-on-llama3", "mscale-alone"],
)
def test_a_config_the_scaling_cannot_honour_is_one_line_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig(**SMALL, **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}, r"'rope_factor' = 0.5: must be >= 1"),
        ({"rope_type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG, "original_max_position_embeddings": 64},
         "rope_short_factor, one factor per RoPE pair: head_dim / 2 = 8 numbers, got 4"),
        ({"rope_type": "longrope", "long_factor": LONG, "original_max_position_embeddings": 64}, "'longrope' needs short_factor"),
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "RoPE scaling 'ntk-by-parts' is not supported; lmforge implements rope_type 'default'"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}, "RoPE scaling 'yarn' has a non-numeric parameter"),
    ],
    ids=["yarn-factor-below-1", "longrope-short-length", "longrope-no-short", "unknown-type", "non-numeric"],
)
def test_a_config_json_the_scaling_cannot_honour_is_an_input_error_naming_the_file(rope, message):
    config = {**hf_config_dict(ModelConfig(**SMALL)), "rope_scaling": rope, "rope_parameters": None}
    with pytest.raises(InputError, match=message) as info:
        model_config_from_hf(config, where="hf/config.json")
    assert str(info.value).startswith("hf/config.json: ") and "\n" not in str(info.value)


def test_config_json_keys_the_type_does_not_read_are_named_in_a_warning(monkeypatch):
    import lmforge.model.hf_parts as hf

    warnings = []
    monkeypatch.setattr(hf.log, "warning", lambda message, *args: warnings.append(message % args))
    rope = {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}
    config = {**hf_config_dict(ModelConfig(**SMALL)), "rope_scaling": rope, "rope_parameters": None}
    assert model_config_from_hf(config, where="hf/config.json").rope_factor == 2.0
    assert warnings == ["hf/config.json: RoPE scaling 'linear' does not read low_freq_factor (transformers ignores them too)"]
