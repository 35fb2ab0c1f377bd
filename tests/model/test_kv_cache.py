"""The KV cache: int8 and int4 storage round each key and value to within half a step of the
model's (checked against a numpy rounding of the stated scheme), attention reads exactly the
rounded values (prefill, decoding, the sliding-window ring, continuous batching's select and
merge), a decode step's attention output stays inside the error propagated from those steps,
and bytes per token follow from the shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.inference.engine import Engine, GenerationConfig, Request, decode_step, generate, prefill
from lmforge.model import kv_cache
from lmforge.model.config import ModelConfig
from lmforge.model.kv_cache import KVCache, new_cache
from lmforge.model.transformer import Transformer

CFG = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
PROMPTS = [[0, 17, 45, 300, 8, 91, 2, 77, 5, 12, 400], [0, 250, 3], [0, 9, 9, 130, 41, 66, 200]]


def model_of(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**CFG, **kw})).eval()


# --------------------------------------------------------------------------- the rounding, against numpy


def numpy_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stated scheme: per row of the last axis s = max|x| / 127, x̂ = round(x / s)·s."""
    s = np.abs(x).max(axis=-1, keepdims=True) / 127
    return np.clip(np.round(x / s), -127, 127) * s, s


def numpy_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Per run of ``group`` values: m = min, s = (max - min) / 15, x̂ = m + round((x - m) / s)·s."""
    g = x.reshape(*x.shape[:-1], -1, group)
    low = g.min(axis=-1, keepdims=True)
    s = (g.max(axis=-1, keepdims=True) - low) / 15
    rounded = low + np.clip(np.round((g - low) / s), 0, 15) * s
    return rounded.reshape(x.shape), np.broadcast_to(s, g.shape).reshape(x.shape)


def numpy_rounding(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x̂, the step of each element)."""
    if kind == "int8":
        rounded, s = numpy_int8(x)
        return rounded, np.broadcast_to(s, x.shape)
    return numpy_int4(x, kv_cache.int4_group(x.shape[-1]))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("width", [16, 128])
def test_each_stored_element_is_the_stated_rounding_within_half_a_step(kind, width):
    k = torch.randn(2, 3, 5, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    v = 3 * torch.randn(2, 3, 5, width, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    cache = new_cache(kind, layers=1, batch=2, heads=3, widths=(width, width), max_len=5, window=None,
                      dtype=torch.float32, device="cpu")
    read_k, read_v = cache.store(0, k, v)
    for x, read in ((k, read_k), (v, read_v)):
        expected, step = numpy_rounding(kind, x.double().numpy())
        # float32 arithmetic against float64's: a few ulps of the largest magnitude
        np.testing.assert_allclose(read.double().numpy(), expected, atol=4e-7 * float(x.abs().max()), rtol=0)
        error = np.abs(read.double().numpy() - x.double().numpy())
        assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all()
        assert error.max() > step.max() / 4  # the values were rounded: the test can fail


def test_all_zero_keys_round_to_zeros_and_never_nan():
    for kind in ("int8", "int4"):
        cache = new_cache(kind, layers=1, batch=1, heads=1, widths=(8, 8), max_len=2, window=None,
                          dtype=torch.float32, device="cpu")
        k, v = cache.store(0, torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
        assert torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.zeros_like(v))


# --------------------------------------------------------------------------- bytes per token


@pytest.mark.parametrize("head_dim,kv_heads", [(64, 2), (128, 2), (64, 1)])
def test_bytes_per_token_follow_from_the_shapes(head_dim, kv_heads):
    layers = 3
    model = Transformer(ModelConfig(vocab_size=64, d_model=4 * head_dim, n_layers=layers, n_heads=4, n_kv_heads=kv_heads,
                                    head_dim=head_dim, max_seq_len=32))
    per_head = {  # bytes of one position's key or value in one head
        "fp32": 4 * head_dim, "auto": 4 * head_dim, "bf16": 2 * head_dim, "fp16": 2 * head_dim,
        "int8": head_dim + 4,  # int8 values + one float32 scale
        "int4": head_dim // 2 + 2 * 4 * (head_dim // 64),  # packed nibbles + a float32 step and minimum per 64 values
    }
    for kind, size in per_head.items():
        cache = model.new_kv_cache(3, 20, torch.float32, "cpu", kind)
        assert cache.bytes_per_token() == layers * 2 * kv_heads * size
        assert cache.nbytes() == cache.bytes_per_token() * 3 * 20


def test_a_ring_cache_holds_the_window_and_a_bad_kind_or_width_is_refused():
    model = model_of(sliding_window=4)
    assert model.new_kv_cache(1, 40, torch.float32, "cpu", "int8").capacity == 4
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'"):
        model.new_kv_cache(1, 40, torch.float32, "cpu", "int3")
    with pytest.raises(ValueError, match="width of 7 is odd"):
        new_cache("int4", layers=1, batch=1, heads=1, widths=(7, 8), max_len=2, window=None, dtype=torch.float32,
                  device="cpu")


# --------------------------------------------------------------------------- attention reads the rounded values


class NumpyRoundedCache(KVCache):
    """A float32 cache holding numpy's rounding of each key and value: the quantised caches' reference."""

    kind = "int8"

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        def rounded(x):
            return torch.from_numpy(numpy_rounding(self.kind, x.double().numpy())[0]).float()

        return {"k": rounded(k), "v": rounded(v)}


def with_reference(monkeypatch, kind: str) -> None:
    """Make ``kind`` build the numpy-rounded float32 cache."""
    reference = type(f"Numpy{kind}", (NumpyRoundedCache,), {"kind": kind})
    monkeypatch.setitem(kv_cache.CACHE_CLASSES, kind, reference)


def engine_logprobs(model: Transformer, kind: str, max_batch: int) -> list[list[float]]:
    """Greedy continuations of prompts that join a running batch and leave it (select and merge)."""
    engine = Engine(model, max_batch=max_batch, kv_cache_dtype=kind)
    ids = [engine.submit(Request(p, GenerationConfig(max_new_tokens=n, temperature=0.0, stop_token_ids=[])))
           for p, n in zip(PROMPTS * 2, [9, 3, 6, 4, 8, 5])]
    results = dict(engine.run())
    return [results[i][0].logprobs for i in ids]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("window", [None, 4])
@torch.no_grad()
def test_continuous_batching_over_a_quantised_cache_computes_the_model_on_the_rounded_keys_and_values(
        kind, window, monkeypatch):
    model = model_of(sliding_window=window)  # a window of 4: every layer slides, the cache is a ring
    got = engine_logprobs(model, kind, max_batch=2)
    with monkeypatch.context() as patch:
        with_reference(patch, kind)
        expected = engine_logprobs(model, kind, max_batch=2)
    full = engine_logprobs(model, "auto", max_batch=2)
    for g, e in zip(got, expected):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-5, rtol=0)
    assert max(abs(a - b) for g, f in zip(got, full) for a, b in zip(g, f)) > 1e-6  # it was rounded


@torch.no_grad()
def test_greedy_decoding_over_an_int8_cache_keeps_the_full_caches_tokens():
    model = model_of()
    config = GenerationConfig(max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    full = [g.tokens for g in generate(model, PROMPTS, config)]
    assert [g.tokens for g in generate(model, PROMPTS, config, kv_cache_dtype="int8")] == full


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.no_grad()
def test_a_decode_steps_attention_output_is_within_the_error_propagated_from_the_rounding(kind):
    """Layer 0 sees the same input under either cache, so its output differs by the rounding alone.
    Per head, a score q·k/√d moves by at most |q|₂ |Δk|₂ / √d (|Δk| ≤ step/2 per element); softmax
    moves by at most twice the largest score change in the 1-norm; the output y = Σ p_j v_j by
    |Δp|₁ max|v̂| + max|Δv| per column; and wo's output by |wo| times that."""
    model = model_of()
    cfg = model.cfg
    outputs, inputs = {}, {}

    def hook(name):
        def record(module, args, out):
            inputs[name], outputs[name] = args[0], out
        return record

    attn = model.layers[0].attn
    batches = {}
    for name in ("auto", kind):
        batches[name] = batch = prefill(model, [PROMPTS[0]], extra=2, kv_cache_dtype=name)
        handle = attn.register_forward_hook(hook(name))
        decode_step(model, torch.tensor([5]), batch)
        handle.remove()
    torch.testing.assert_close(inputs[kind], inputs["auto"], atol=0, rtol=0)
    cache = batches[kind].cache
    tensors, S, d = cache.tensors, cache.length, cfg.head_dim

    def half_steps(name):  # (kv_heads, S, head_dim): half the step of each cached element of layer 0
        step = tensors[f"{name}_scale"][0, 0, :, :S]
        return step.repeat_interleave(d // step.shape[-1], dim=-1) / 2

    dk, dv = half_steps("k"), half_steps("v")
    _, v_read = cache.decode({n: t[0, :, :, :S] for n, t in tensors.items()})  # layer 0's values as attention read them
    q = attn.wq(inputs[kind][0, -1]).view(cfg.n_heads, d)  # before RoPE: a rotation keeps |q|₂
    group = cfg.n_heads // cfg.n_kv_heads
    dy = []
    for h in range(cfg.n_heads):
        g = h // group
        score_change = q[h].norm() * dk[g].norm(dim=-1).max() / d**0.5
        dy.append(2 * score_change * v_read[0, g].abs().amax(dim=0) + dv[g].amax(dim=0))
    bound = attn.wo.weight.abs() @ torch.cat(dy)
    error = (outputs[kind] - outputs["auto"])[0, -1].abs()
    assert (error <= bound * (1 + 1e-4) + 1e-6).all()
    assert error.max() > 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.no_grad()
def test_chunks_fed_into_a_quantised_ring_read_the_rounded_keys_the_reference_ring_holds(kind, monkeypatch):
    """Several new positions after a wrapped prefix (the ring's kept slots, then the new ones)."""
    model = model_of(sliding_window=8)
    x = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))

    def chunked() -> torch.Tensor:
        cache = model.new_kv_cache(2, 40, torch.float32, "cpu", kind)
        out, at = [], 0
        for n in [5, 11, 3, 1, 20]:
            out.append(model(x[:, at : at + n], kv_cache=cache))
            at += n
        assert cache.capacity == 8
        return torch.cat(out, dim=1)

    got = chunked()
    with monkeypatch.context() as patch:
        with_reference(patch, kind)
        expected = chunked()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.no_grad()
def test_a_bfloat16_model_reads_its_quantised_cache_back_in_bfloat16(kind):
    model = model_of().to(torch.bfloat16)
    batch = prefill(model, PROMPTS, 3, kv_cache_dtype=kind)
    assert batch.cache.dtype == torch.bfloat16 and batch.cache.tensors["k"].dtype != torch.bfloat16
    k, v = batch.cache.decode({n: t[0] for n, t in batch.cache.tensors.items()})
    assert k.dtype == v.dtype == torch.bfloat16
    full = generate(model, PROMPTS, GenerationConfig(max_new_tokens=3, temperature=0.0, stop_token_ids=[]))
    quantised = generate(model, PROMPTS, GenerationConfig(max_new_tokens=3, temperature=0.0, stop_token_ids=[]),
                         kv_cache_dtype=kind)
    assert [len(g.tokens) for g in quantised] == [len(g.tokens) for g in full] == [3, 3, 3]
