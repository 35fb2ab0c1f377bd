"""One forward: every model variant gives the same logits through a training forward, cached
decoding (the inference engine's prefill and decode steps, on its decoding layout), a pipeline
split (the stage modules run one after another) and its Hugging Face export; and each module
the decoding layout puts in a plain module's place computes what the plain module computes.

Every field of every family's config (``lmforge.model.families``) is either changed by a
variant of that family here or listed in ``NOT_ARITHMETIC`` with the reason; a new field, or
a new family, fails ``test_every_config_field_of_every_family_is_covered`` until a variant covers it.
A variant names its family with ``family`` (the Llama family otherwise).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields

import pytest
import torch

import tests.model.families
from lmforge.distributed.mesh import stage_layer_ranges
from lmforge.inference.engine import decode_step, decoding_view, prefill
from lmforge.model.config import ModelConfig
from lmforge.model.families import FAMILIES, model_config
from lmforge.model.fused import PackedLinear, fused_copy, joined_linear, onednn_packs, structural_copy
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.transformer import Transformer, apply_rope, pair_rotations, rotation_pair_order, rotation_tables
from tests.model.test_hf import randomized

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, ffn_hidden=96, max_seq_len=64, rope_theta=50000.0)
VARIANTS = {
    "mha": {},
    # µP 4x its base, heads 4x wider: the readout and score multipliers, folded into the export (hf.fold_mup)
    "mup": dict(mup={"base_width": 16, "base_head_dim": 4}, n_kv_heads=2, qkv_bias=True),
    "mup-qk-norm-tied": dict(mup={"base_width": 16, "base_head_dim": 4}, qk_norm=True, tie_embeddings=True),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1, head_dim=32),  # head_dim other than d_model / n_heads
    "tied": dict(tie_embeddings=True, n_kv_heads=2),
    "qk-norm": dict(qk_norm=True, n_kv_heads=2, norm_eps=1e-6),  # Qwen3
    "qkv-bias": dict(qkv_bias=True, n_kv_heads=2),  # Qwen2
    "all-biases": dict(qkv_bias=True, out_bias=True, mlp_bias=True),  # Llama with biases
    "gpt2-like": dict(norm="layernorm", ffn="gelu", ffn_hidden=None, qkv_bias=True, out_bias=True, mlp_bias=True),
    "llama3-rope": dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_seq_len=16, tie_embeddings=True, n_kv_heads=2),
    "linear-rope": dict(rope_scaling="linear", rope_factor=4.0, n_kv_heads=2),  # position interpolation
    # head_dim 32: the ramp runs between pairs 1.4 and 4.5, so every YaRN key shapes the tables
    "yarn-rope": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64, rope_beta_fast=4.0, rope_beta_slow=0.5,
                      rope_mscale=1.0, rope_mscale_all_dim=0.5, rope_truncate=False, n_kv_heads=2, head_dim=32),
    "yarn-attention-factor": dict(rope_scaling="yarn", rope_factor=8.0, rope_original_max_seq_len=16, rope_attention_factor=1.2),
    # The length-dependent types give each forward the frequencies of its length, so cached decoding
    # equals a full recompute only where every forward falls on one side of the original context:
    # dynamic NTK within it (past it, test_rope.py checks cached decoding against transformers' own cache),
    # LongRoPE past it (its long factors; within it its short ones), with every prompt longer than 2.
    "dynamic-ntk": dict(rope_scaling="dynamic", rope_factor=2.0, rope_original_max_seq_len=32, n_kv_heads=2),
    "longrope": dict(rope_scaling="longrope", rope_factor=4.0, rope_original_max_seq_len=2, n_kv_heads=2,
                     rope_short_factor=[1.0 + 0.5 * i for i in range(8)], rope_long_factor=[1.0 + 2.0 * i for i in range(8)]),
    # windows shorter than the 17-token rows: every layer windowed (Mistral; its cache is a ring of 6 slots), or
    # some (Qwen2's layer_types); a window of 1 sees the query alone
    "sliding-window": dict(sliding_window=6, n_kv_heads=2),
    "sliding-layers": dict(sliding_window=5, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                          "full_attention"], qkv_bias=True, n_kv_heads=2),
    "alibi": dict(positions="alibi", n_heads=8, n_kv_heads=4, head_dim=8),  # 8 slopes, 2^-1 .. 2^-8
    "learned-positions": dict(positions="learned", n_kv_heads=2),  # GPT-2's absolute positions
    "alibi-sliding-window": dict(positions="alibi", n_heads=6, head_dim=16, sliding_window=4),  # 6 heads: 4 + 2 slopes
}
# variant -> what the one-line ValueError of its Hugging Face export names, where no HF class computes it
HF_REFUSED = {
    "gpt2-like": "RMSNorm + SwiGLU",
    **dict.fromkeys(("alibi", "alibi-sliding-window"), "positions 'alibi'"),
    "learned-positions": "positions 'learned'",
}
# family -> its config's fields that no variant changes, and why (beyond NOT_ARITHMETIC and a config's FIXED_FIELDS)
FAMILY_NOT_ARITHMETIC: dict[str, dict[str, str]] = {}
# family -> (its export's HF weights, cfg) -> the HF class's own state dict, where transformers lays the weights
# out otherwise in memory than on disk (transformers 5 fuses a mixture's per-expert matrices as it loads them)
HF_IN_MEMORY: dict = {}
# variant -> why it is compared in float32 only (each family's PARITY_FLOAT32_ONLY)
FLOAT32_ONLY: dict[str, str] = {}
# each family's own: ``PARITY_VARIANTS`` (named "<family>:..."), ``PARITY_HF_REFUSED`` and
# ``PARITY_NOT_ARITHMETIC`` of its tests/model/families/test_<family>.py
for _module in pkgutil.iter_modules(tests.model.families.__path__):
    _family_tests = importlib.import_module(f"tests.model.families.{_module.name}")
    VARIANTS |= getattr(_family_tests, "PARITY_VARIANTS", {})
    HF_REFUSED |= getattr(_family_tests, "PARITY_HF_REFUSED", {})
    FAMILY_NOT_ARITHMETIC |= getattr(_family_tests, "PARITY_NOT_ARITHMETIC", {})
    HF_IN_MEMORY |= getattr(_family_tests, "PARITY_HF_IN_MEMORY", {})
    FLOAT32_ONLY |= getattr(_family_tests, "PARITY_FLOAT32_ONLY", {})
NOT_ARITHMETIC = {
    "preset": "names a set of the other fields' values, which the variants set directly",
    "init_std": "the initial weights only; the test draws its own random weights",
    **dict.fromkeys(("embed_dropout", "attn_dropout", "resid_dropout"),
                    "training only (evaluation, decoding and export compute without it): test_transformer.py's dropout tests"),
    "mtp": "the multi-token prediction modules run in training and drafting only, never in the model's forward "
           "(export leaves them out): tests/model/test_mtp.py, tests/inference/test_speculative.py",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPTS = [[1, 17, 45, 200, 8, 91, 2, 77, 5, 12, 250, 33], [1, 250, 3], [1, 9, 9, 130, 41, 66, 200]]
FEED = [[7, 70, 170, 3, 99], [12, 5, 5, 240, 1], [60, 61, 62, 63, 64]]  # tokens fed after each prompt


def tolerance(dtype: torch.dtype, n_layers: int, scale: float) -> float:
    """How far two orders of the same arithmetic may fall apart, in absolute logits.

    float32: each route rounds every product and sum to 24 bits (relative 6e-8); over the few
    hundred terms of a dot product and the 2L + 1 residual updates the differences stay under
    1e-6 of the logits' scale, so 1e-5 absolute (at logits of order 1) leaves room and still
    catches any wrong term. 16-bit: the routes differ by where values are rounded to 16 bits
    (eps 2^-8 for bfloat16, 2^-11 for float16; attention runs upcast over whole sequences and in
    16 bits against the cache, see ``attend``), and each of the 2L + 2 roundings of the
    residual stream and the head may move a logit by one eps of the scale: (2L + 2) eps x scale.
    """
    if dtype == torch.float32:
        return 1e-5 * max(scale, 1.0)
    eps = torch.finfo(dtype).eps
    return (2 * n_layers + 2) * eps * scale


def full_logits(model: Transformer, rows: list[list[int]]) -> list[torch.Tensor]:
    """The training forward of each row alone: logits (T, V) in float32."""
    with torch.no_grad():
        return [model(torch.tensor([row]))[0].float() for row in rows]


def variant_config(variant: str):
    return model_config({**BASE, **VARIANTS[variant]})


def test_every_config_field_of_every_family_is_covered():
    for family in FAMILIES.values():
        variants = {n: v for n, v in VARIANTS.items() if v.get("family", "llama") == family.name}
        assert variants, f"family {family.name!r} has no parity variant: add one (with family={family.name!r})"
        covered = {"family"} | set(BASE) | {k for v in variants.values() for k in v}
        # a field the family holds at one value (refused at any other, in its own tests) has nothing to vary
        exempt = NOT_ARITHMETIC.keys() | FAMILY_NOT_ARITHMETIC.get(family.name, {}).keys()
        exempt |= getattr(family.config, "FIXED_FIELDS", {}).keys()
        missing = [f.name for f in fields(family.config) if f.name not in covered and f.name not in exempt]
        assert not missing, (f"family {family.name!r}: config fields {missing} are in no parity variant: add a variant "
                             "(or a reason to NOT_ARITHMETIC)")
    for name, changes in VARIANTS.items():  # each variant changes what it names
        default = model_config({**BASE, "family": changes.get("family", "llama")})
        assert any(getattr(variant_config(name), k) != getattr(default, k) for k in changes) or name == "mha"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_forward_cached_decoding_pipeline_and_hf_give_the_same_logits(variant, dtype):
    if dtype != "float32" and variant in FLOAT32_ONLY:
        pytest.skip(f"{variant}: {FLOAT32_ONLY[variant]}")
    cfg = variant_config(variant)
    # weights of a scale that gives logits of order 1: a misplaced gain, bias or column shows
    model = randomized(cfg, matrix_std=0.1).to(DTYPES[dtype])
    rows = [p + f for p, f in zip(PROMPTS, FEED)]
    expected = full_logits(model, rows)
    scale = max(float(e.abs().max()) for e in expected)
    atol = tolerance(DTYPES[dtype], cfg.n_layers, scale)

    # cached decoding: a left-padded prefill of prompts of different lengths, then one token a step
    net = decoding_view(model)
    with torch.inference_mode():
        batch = prefill(net, PROMPTS, extra=len(FEED[0]))
        for step in range(len(FEED[0])):
            for row, prompt in enumerate(PROMPTS):
                got = batch.logits[row].float()
                torch.testing.assert_close(got, expected[row][len(prompt) - 1 + step], atol=atol, rtol=0)
            decode_step(net, torch.tensor([f[step] for f in FEED]), batch)

    # a pipeline split: the same module with the blocks each stage does not own removed
    tokens = torch.tensor([rows[0]])
    x = tokens
    with torch.no_grad():
        for i, layers in enumerate(stage_layer_ranges(cfg.n_layers, 3)):  # embedding + 1, 2, 1 + head
            # (a structural copy shares the tensors, so every kernel reads the same memory)
            stage = structural_copy(model).keep_layers(layers, embed=i == 0, head=i == 2)
            x = stage(x)
        # the same operations on the same values: equal to the last bit
        assert torch.equal(x, model(tokens))

    # Hugging Face export, where an HF class computes this variant
    try:
        config = hf_config_dict(cfg)
    except ValueError as exc:
        assert variant in HF_REFUSED and HF_REFUSED[variant] in str(exc), (variant, str(exc))
        return
    assert variant not in HF_REFUSED, f"{variant}: its export was expected to be refused"
    hf_cfg = transformers.AutoConfig.for_model(**config)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    exported = state_dict_to_hf(model.float().state_dict(), cfg)
    missing, unexpected = hf.load_state_dict(HF_IN_MEMORY.get(cfg.family, lambda s, _: s)(exported, cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if cfg.tie_embeddings:
        hf.tie_weights()
    hf.to(DTYPES[dtype])
    with torch.no_grad():
        theirs = hf(torch.tensor([rows[1]])).logits[0].float()
    torch.testing.assert_close(theirs, expected[1], atol=atol, rtol=0)


# --------------------------------------------------------------------------- the decoding layout's modules


def linear_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The most by which ``x @ weight.T + bias`` may miss its exact value, element by element,
    when computed as ``F.linear`` and oneDNN do: float32 products and sums in any order and, for
    16-bit operands, the sum rounded to 16 bits, then the bias added and rounded again.

    Any order of the K + 1 float32 sums errs by at most γ = (K+1)u / (1 - (K+1)u) times the sum
    of magnitudes M = |x|·|w| + |b| (Higham, Accuracy and Stability of Numerical Algorithms,
    eq. 3.5; u = 2^-24; 16-bit products are exact in float32). A 16-bit rounding r = fl(s) adds
    at most u16 |s| (u16 = eps / 2): fl(fl(s) + b) is within γM + u16 (2 + u16)(|x·w| + γM) + u16 |b|.
    A wrong or missing column, bias or gain misses by far more in float32.
    """
    x64, w64 = x.double(), weight.double()
    b64 = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    K, u = weight.shape[1], 2.0**-24
    sums = (K + 1) * u / (1 - (K + 1) * u) * (x64.abs() @ w64.abs().T + b64.abs())
    if x.dtype == torch.float32:
        return sums
    u16 = torch.finfo(x.dtype).eps / 2
    return sums + u16 * (2 + u16) * ((x64 @ w64.T).abs() + sums) + u16 * b64.abs()


def linears(dtype: torch.dtype, sizes: tuple[int, ...], bias: bool, seed: int) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(48, n, bias=bias).to(dtype).eval() for n in sizes]


LINEAR_INPUTS = {  # the shapes the decoding copy's projections see
    "decode step (B, 1, d)": lambda dtype: torch.randn(3, 1, 48).to(dtype),
    "prefill (B, T, d)": lambda dtype: torch.randn(2, 7, 48).to(dtype),
    "last position (B, d), strided": lambda dtype: torch.randn(3, 5, 48).to(dtype)[:, -1],
}


@pytest.mark.parametrize("inputs", list(LINEAR_INPUTS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@torch.no_grad()
def test_a_joined_or_packed_projection_computes_the_plain_projections(dtype, pack, bias, inputs):
    if pack and not onednn_packs(DTYPES[dtype], torch.device("cpu")):
        pytest.skip(f"this CPU's oneDNN has no {dtype} kernels; the decoding copy keeps nn.Linear")
    plain = linears(DTYPES[dtype], (40, 24, 24), bias, seed=1)  # q, k, v of different widths
    joined = joined_linear(plain, pack)
    assert type(joined) is (PackedLinear if pack else torch.nn.Linear)
    x = LINEAR_INPUTS[inputs](DTYPES[dtype])
    got = joined(x)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], 88)
    weight = torch.cat([m.weight for m in plain])
    b = torch.cat([m.bias for m in plain]) if bias else None
    exact = x.double() @ weight.double().T + (b.double() if bias else 0.0)
    bound = linear_error_bound(x, weight, b)
    assert ((got.double() - exact).abs() <= bound).all()  # the joined one within float rounding of exact
    expected = torch.cat([m(x) for m in plain], dim=-1)  # and of the plain modules, which err as much
    assert ((got.double() - expected.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@torch.no_grad()
def test_rope_in_pair_order_rotates_as_the_halves_layout(dtype):
    cfg = ModelConfig(**BASE)
    model = Transformer(cfg).to(DTYPES[dtype])  # a 16-bit model's tables are 16-bit too
    x = torch.randn(2, 3, 9, cfg.head_dim).to(DTYPES[dtype])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 40, 41, 63]])
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    order = rotation_pair_order(cfg.head_dim, 1)
    halves = apply_rope(x, rotation_tables(cos, sin))[..., order]
    pairs = apply_rope(x[..., order], pair_rotations(cos, sin))
    assert pairs.dtype == x.dtype
    # each output is a·c ∓ b·d of the same four values: two products and a sum, each rounded
    # at most once (relative u) in float32; in 16 bits the halves route rounds both products
    # and the sum to 16 bits (u16 each), the pair route only its float32 result
    partner = x.roll(cfg.head_dim // 2, dims=-1)[..., order].double()
    c = torch.cat((cos, cos), -1)[:, None][..., order].double()
    s_ = torch.cat((sin, sin), -1)[:, None][..., order].double()
    magnitude = (x[..., order].double() * c).abs() + (partner * s_).abs()
    u = 2.0**-24
    u16 = torch.finfo(DTYPES[dtype]).eps / 2 if dtype != "float32" else 0.0
    bound = (4 * u + 3 * u16 * (1 + u16)) * magnitude
    assert ((pairs.double() - halves.double()).abs() <= bound).all()


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "qk-norm", "qkv-bias"])
@torch.no_grad()
def test_the_decoding_layouts_attention_computes_the_plain_attention(variant):
    """q/k rows in pair order, joined and packed as ``fused_copy`` lays them out: the same dot
    products q·k (their terms permuted alike), so the output matches to float32 summation order."""
    cfg = variant_config(variant)
    model = randomized(cfg, matrix_std=0.1)
    fused = fused_copy(model, pack=onednn_packs(torch.float32, torch.device("cpu")))
    x = torch.randn(2, 11, cfg.d_model)
    cos, sin = model.rope_cos[None, :11], model.rope_sin[None, :11]
    plain = model.layers[1].attn(x, rotation_tables(cos, sin))
    got = fused.layers[1].attn(x, pair_rotations(cos, sin))
    atol = tolerance(torch.float32, 1, float(plain.abs().max()))
    torch.testing.assert_close(got, plain, atol=atol, rtol=0)
