import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.model.config import ModelConfig
from lmforge.model.families import PRESETS, build
from lmforge.model.transformer import Transformer, attend

VARIANTS = [
    dict(),
    dict(n_kv_heads=2),
    dict(n_kv_heads=1, tie_embeddings=True),
    dict(ffn="gelu", norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True),
    dict(qk_norm=True, qkv_bias=True),
    dict(head_dim=8, n_heads=4),
]


def small(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 97, "d_model": 48, "n_layers": 2, "n_heads": 4, "ffn_hidden": 80, "max_seq_len": 64, **kw})


@pytest.mark.parametrize("kw", VARIANTS)
def test_parameter_count_formula_matches_the_built_model(kw):
    cfg = small(**kw)
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


# GPT-2 small: 124,439,808 parameters with its tied head (openai-community/gpt2)
@pytest.mark.parametrize("name, expected", [("tiny", 16.91e6), ("gpt2-124m", 124.44e6), ("smollm2-135m", 134.5e6), ("llama3-1b", 1235.8e6)])
def test_presets_have_their_published_sizes(name, expected):
    cfg = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = build(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == cfg.num_params()
    assert counted == pytest.approx(expected, rel=0.005)


def test_recipe_preset_fills_fields_and_explicit_keys_win():
    from lmforge.core.config import load_config
    from lmforge.stages.pretrain import PretrainRecipe

    recipe = load_config(PretrainRecipe, None, ["model.preset=smollm2-135m", "model.n_layers=4", "model.tie_embeddings=false"])
    assert recipe.model.d_model == 576 and recipe.model.n_kv_heads == 3
    assert recipe.model.n_layers == 4 and recipe.model.tie_embeddings is False


def test_flops_per_token_is_6n_plus_the_attention_term():
    cfg = small()
    n = cfg.matmul_params()
    assert cfg.flops_per_token(32) == 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 32
    # matmul parameters: every projection and the output head, not the embedding lookup or norms
    linear = sum(m.weight.numel() for m in Transformer(cfg).modules() if isinstance(m, torch.nn.Linear))
    assert n == linear


def test_logits_are_causal():
    torch.manual_seed(0)
    model = Transformer(small()).eval()
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :10], model(y)[:, :10], atol=1e-6)


def test_logits_at_chosen_positions_are_those_rows_of_the_full_logits():
    torch.manual_seed(0)
    model = Transformer(small(tie_embeddings=True)).eval()
    x = torch.randint(0, 97, (3, 12))
    at = torch.rand(3, 12) < 0.3
    with torch.no_grad():
        full, picked = model(x), model(x, head_at=at)
    assert picked.shape == (int(at.sum()), 97)
    torch.testing.assert_close(picked, full[at], atol=1e-6, rtol=1e-5)  # the same rows: only the matmul's M differs


def test_explicit_positions_equal_the_default():
    model = Transformer(small()).eval()
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(x), model(x, positions=torch.arange(12).expand(2, 12)), atol=1e-6)


def test_initialisation_scales_residual_projections():
    torch.manual_seed(0)
    cfg = small(d_model=256, n_layers=8, ffn_hidden=512, n_heads=4)
    model = Transformer(cfg)
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].attn.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.layers[0].mlp.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert (model.layers[0].attn_norm.weight == 1).all()


def test_tied_embeddings_share_one_matrix():
    model = Transformer(small(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight


def test_invalid_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        small(n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_preset("gpt5")
    assert set(PRESETS) >= {"tiny", "gpt2-124m", "smollm2-135m", "llama3-1b"}


def test_rope_scaling_settings_are_validated():
    llama3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=32)
    assert small(**llama3).rope_high_freq_factor == 4.0  # Meta's band edges are the defaults
    with pytest.raises(ValueError, match="rope_factor=8.0 set but rope_scaling is 'none', which does not read it; "
                                         "set rope_scaling to dynamic or linear or llama3 or longrope or yarn"):
        small(rope_factor=8.0)
    with pytest.raises(ValueError, match="needs rope_original_max_seq_len"):
        small(rope_scaling="llama3", rope_factor=8.0)
    with pytest.raises(ValueError, match="'rope_factor' = 0.5: must be >= 1"):
        small(**{**llama3, "rope_factor": 0.5})
    with pytest.raises(ValueError, match="rope_low_freq_factor = 4.0 must be below rope_high_freq_factor = 4.0"):
        small(**llama3, rope_low_freq_factor=4.0)
    with pytest.raises(ValueError, match="rope_scaling 'ntk' is not supported; choose one of 'none', 'linear', 'dynamic'"):
        small(rope_scaling="ntk")


def test_recipe_sets_rope_scaling_and_old_model_json_loads_without_it(tmp_path):
    import dataclasses
    import json

    from lmforge.checkpoints.files import load_model_config
    from lmforge.core.config import load_config
    from lmforge.stages.pretrain import PretrainRecipe

    keys = ["model.preset=tiny", "model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_original_max_seq_len=256"]
    recipe = load_config(PretrainRecipe, None, keys)
    assert (recipe.model.rope_scaling, recipe.model.rope_factor, recipe.model.rope_original_max_seq_len) == ("llama3", 8.0, 256)

    old = {k: v for k, v in dataclasses.asdict(small()).items() if not k.startswith("rope_") or k == "rope_theta"}
    (tmp_path / "model.json").write_text(json.dumps(old))  # written before RoPE scaling existed
    assert load_model_config(tmp_path) == small()


def attention_case(dtype: torch.dtype, requires_grad: bool):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 16, dtype=dtype, requires_grad=requires_grad)
    k, v = (torch.randn(2, 2, 48, 16, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


def reference_attention(q, k, v):
    """Causal GQA attention in float64, written out."""
    q, k, v = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attend_in_training_is_at_least_as_accurate_as_16_bit_sdpa(dtype):
    """``attend``'s float32 route for CPU training (no AMX) keeps the 16-bit output dtype and is
    no further from the float64 answer, in value and in gradients, than the 16-bit kernel."""
    # seeded: the comparison is of one draw's largest errors, which the global RNG state left by other
    # tests (their order under xdist) must not choose
    grad = torch.randn(2, 4, 48, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    errors = {}
    for name in ("attend", "sdpa", "reference"):
        q, k, v = attention_case(dtype, requires_grad=True)
        if name == "attend":
            y = attend(q, k, v, None, True)
        elif name == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = reference_attention(q, k, v)
        assert y.dtype == (torch.float64 if name == "reference" else dtype)
        y.backward(grad.to(y.dtype))
        errors[name] = [y.double(), q.grad.double(), k.grad.double(), v.grad.double()]
    ref = errors.pop("reference")
    for name in ("attend", "sdpa"):
        errors[name] = [(a - b).abs().max().item() for a, b in zip(errors[name], ref)]
    for ours, theirs in zip(errors["attend"], errors["sdpa"]):
        assert ours <= theirs * 1.05 + 1e-6, errors


def test_attend_under_autocast_with_and_without_gradients_and_when_decoding():
    """Under bf16 autocast the output is bf16 as SDPA's is; a full sequence without gradients
    (evaluation, a DPO reference) computes exactly what it computes with them; ``decoding``
    (a step against a KV cache) is exactly the 16-bit SDPA call."""
    q, k, v = attention_case(torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(q, k, v, None, True)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with torch.no_grad():
            assert torch.equal(attend(q, k, v, None, True), y.detach())
    assert y.dtype == sdpa.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), sdpa.float(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32
    q, k, v = attention_case(torch.bfloat16, requires_grad=False)
    decoded = attend(q, k, v, None, True, decoding=True)
    assert torch.equal(decoded, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("key", ["embed_dropout", "attn_dropout", "resid_dropout"])
def test_dropout_acts_in_training_only(key):
    """Each dropout is wired (training logits move), seeded (the same seed, the same drops) and
    off in evaluation, where the model computes exactly what the same weights without dropout do."""
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)
    plain = ModelConfig(**base)
    dropped = ModelConfig(**base, **{key: 0.5})
    torch.manual_seed(0)
    model = Transformer(dropped)
    reference = Transformer(plain)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), reference.eval()(tokens))
        model.train()
        torch.manual_seed(1)
        first = model(tokens)
        torch.manual_seed(1)
        again = model(tokens)
        torch.manual_seed(2)
        other = model(tokens)
    assert torch.equal(first, again)
    assert not torch.allclose(first, reference(tokens)) and not torch.allclose(first, other)
