"""The generation engine: cached decoding computes what a full recompute computes, padding
keeps batch rows apart, the samplers do what their papers say, and stopping works."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from lmforge.model import transformer as transformer_module
from lmforge.model.config import ModelConfig
from lmforge.model.generate import (
    FusedTransformer,
    GenerationConfig,
    decode_step,
    decoding_matmul_dtype,
    decoding_view,
    generate,
    prefill,
    sample_next_token,
    top_k_filter,
    top_p_filter,
)
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.transformer import KVCache, Transformer
from lmforge.peft.lora import LoraConfig, apply_lora

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CFG = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
PROMPTS = [[0, 17, 45, 300, 8, 91, 2, 77, 5, 12, 400], [0, 250, 3], [0, 9, 9, 130, 41, 66, 200]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**CFG)).eval()


def greedy(max_new_tokens: int = 12, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=kw.pop("stop_token_ids", []), **kw)


def full_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


# --------------------------------------------------------------------------- cache and padding


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
@torch.no_grad()
def test_cached_decoding_gives_the_logits_of_a_full_recompute(model, fused):
    net = FusedTransformer(model) if fused else model
    prompt = PROMPTS[0]
    logits, state = prefill(net, [prompt], max_new_tokens=10)
    seq = list(prompt)
    for _ in range(10):
        torch.testing.assert_close(logits[0], full_logits(model, seq), atol=1e-5, rtol=0)
        token = int(logits[0].argmax())
        seq.append(token)
        logits = decode_step(net, torch.tensor([token]), state)


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
@torch.no_grad()
def test_each_row_of_a_left_padded_batch_gets_the_logits_of_its_prompt_alone(model, fused):
    net = FusedTransformer(model) if fused else model
    feed = torch.randint(3, 512, (len(PROMPTS), 8), generator=torch.Generator().manual_seed(0))
    logits, state = prefill(net, PROMPTS, max_new_tokens=8)
    assert state.key_mask is not None  # lengths differ, so the batch is padded
    for step in range(8):
        for row, prompt in enumerate(PROMPTS):
            alone = full_logits(model, prompt + feed[row, :step].tolist())
            torch.testing.assert_close(logits[row], alone, atol=1e-5, rtol=0)
        logits = decode_step(net, feed[:, step], state)


@torch.no_grad()
def test_a_multi_token_step_after_a_cached_prefix_is_causal(model):
    tokens = torch.tensor([PROMPTS[0]])
    cache = KVCache.empty(model.cfg, 1, tokens.shape[1], torch.float32, "cpu")
    head = model(tokens[:, :4], kv_cache=cache)
    tail = model(tokens[:, 4:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), model(tokens), atol=1e-5, rtol=0)


def test_greedy_batched_output_equals_greedy_per_prompt(model):
    batched = generate(model, PROMPTS, greedy(16))
    for prompt, got in zip(PROMPTS, batched):
        assert got.tokens == generate(model, [prompt], greedy(16))[0].tokens


def test_greedy_is_the_argmax_of_a_full_recompute_at_every_step(model):
    got = generate(model, [PROMPTS[1]], greedy(16))[0].tokens
    seq = list(PROMPTS[1])
    for _ in range(16):
        seq.append(int(full_logits(model, seq).argmax()))
    assert got == seq[len(PROMPTS[1]) :]


def test_greedy_continuation_equals_transformers_generate(model):
    import transformers
    d = {k: v for k, v in hf_config_dict(model.cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d)).eval()
    missing, unexpected = hf.load_state_dict(state_dict_to_hf(model.state_dict(), model.cfg), strict=False)
    assert not missing and not unexpected
    ours = generate(model, PROMPTS, greedy(20))
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              min_new_tokens=20, eos_token_id=None, pad_token_id=2)
        assert got.tokens == out[0, len(prompt) :].tolist()
    # The same prompts as one left-padded batch, which transformers masks and positions itself.
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, min_new_tokens=20,
                          eos_token_id=None, pad_token_id=2)
    assert [r.tokens for r in ours] == out[:, width:].tolist()


def test_bfloat16_generation_runs_and_caches_in_bfloat16(model):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    results = generate(bf16, PROMPTS, greedy(6))
    assert [len(r.tokens) for r in results] == [6, 6, 6]
    _, state = prefill(bf16, PROMPTS, 6)
    assert state.cache.k.dtype == torch.bfloat16


# --------------------------------------------------------------------------- the fused decoding view


VARIANTS = {
    "llama": {},
    "qwen-like": dict(qkv_bias=True, qk_norm=True, tie_embeddings=True),
    "gpt2-like": dict(ffn="gelu", norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True, n_kv_heads=4),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_fused_view_gives_the_logits_of_the_model_for_every_variant(variant):
    torch.manual_seed(1)
    model = Transformer(ModelConfig(**{**CFG, **VARIANTS[variant]})).eval()
    for p in model.parameters():  # non-zero biases and norm gains other than 1, so a misplaced one shows
        if p.ndim == 1:
            p.add_(0.1 * torch.randn_like(p))
    fused = FusedTransformer(model)
    tokens = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(fused.lm_head(fused.hidden_states(tokens)), model(tokens), atol=1e-5, rtol=0)
    logits, state = prefill(fused, [PROMPTS[0]], max_new_tokens=6)
    seq = list(PROMPTS[0])
    for _ in range(6):
        torch.testing.assert_close(logits[0], full_logits(model, seq), atol=1e-5, rtol=0)
        seq.append(int(logits[0].argmax()))
        logits = decode_step(fused, torch.tensor([seq[-1]]), state)


def test_decoding_view_is_reused_until_a_parameter_changes():
    torch.manual_seed(2)
    model = Transformer(ModelConfig(**CFG)).eval()
    view = decoding_view(model)
    assert isinstance(view, FusedTransformer) and decoding_view(model) is view
    before = generate(model, PROMPTS, greedy(8))
    with torch.no_grad():  # an optimizer step: in place, so the tensors keep their storage
        for p in model.parameters():
            p.mul_(1.5)
    changed = decoding_view(model)
    assert changed is not view
    assert [r.tokens for r in generate(model, PROMPTS, greedy(8))] != [r.tokens for r in before]
    model.to(torch.bfloat16)
    bf16_view = decoding_view(model)
    assert bf16_view is not changed
    assert bf16_view.head.dtype == decoding_matmul_dtype(torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cpu_has_amx", [False, True])
@torch.no_grad()
def test_a_16_bit_view_computes_in_its_dtype_whichever_matrices_it_keeps(monkeypatch, dtype, cpu_has_amx):
    """Without AMX a 16-bit model's view keeps float32 matrices (16-bit matmuls are slow there) and
    rounds each product back; with AMX it keeps the model's dtype. Either way the hidden states
    stay in the model's dtype, and the logits are the 16-bit model's within 16-bit rounding, no
    further from the float32 model's than the 16-bit model's own."""
    monkeypatch.setattr(transformer_module, "CPU_HAS_AMX", cpu_has_amx)
    torch.manual_seed(3)
    model = Transformer(ModelConfig(**{**CFG, **VARIANTS["qwen-like"]})).eval()
    low = copy.deepcopy(model).to(dtype)
    fused = FusedTransformer(low)
    assert fused.head.dtype == (dtype if cpu_has_amx else torch.float32)
    assert {w.wqkv.dtype for w in fused.layers} == {fused.head.dtype}
    tokens = torch.tensor([PROMPTS[0]])
    hidden = fused.hidden_states(tokens)
    assert hidden.dtype == dtype
    logits, reference, exact = fused.lm_head(hidden), low(tokens), model(tokens)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits.float(), reference.float(), atol=0.1, rtol=0.05)
    assert (logits.float() - exact).abs().max() <= 1.5 * (reference.float() - exact).abs().max()
    cached, state = prefill(fused, [PROMPTS[0]], max_new_tokens=2)
    assert state.cache.k.dtype == dtype
    torch.testing.assert_close(cached[0], logits[0, -1])


def test_a_model_with_lora_adapters_generates_through_its_own_modules(model):
    wrapped = copy.deepcopy(model)
    apply_lora(wrapped, LoraConfig(r=4))
    assert decoding_view(wrapped) is wrapped  # the adapters are not folded into a fused copy
    assert [r.tokens for r in generate(wrapped, PROMPTS, greedy(8))] == [r.tokens for r in generate(model, PROMPTS, greedy(8))]


# --------------------------------------------------------------------------- sampling


def test_top_k_one_equals_greedy(model):
    sampled = generate(model, PROMPTS, GenerationConfig(max_new_tokens=12, top_k=1, seed=3, stop_token_ids=[]))
    assert [r.tokens for r in sampled] == [r.tokens for r in generate(model, PROMPTS, greedy(12))]


def test_top_k_filter_keeps_the_k_largest_logits():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.3]])
    kept = top_k_filter(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, False]]
    assert torch.equal(top_k_filter(logits, 0), logits)


@pytest.mark.parametrize(("p", "kept"), [(0.4, {2}), (0.75, {2, 0}), (0.85, {2, 0, 3}), (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_whose_probability_reaches_p(p, kept):
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}  # token -> probability, out of order so the filter must sort
    logits = torch.tensor([[math.log(probs[t]) for t in range(4)]])
    filtered = top_p_filter(logits, p)
    assert {t for t in range(4) if math.isfinite(filtered[0, t])} == kept
    assert all(filtered[0, t] == logits[0, t] for t in kept)


def test_sampling_follows_the_softmax_of_logits_over_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = (probs.log() * 0.5).repeat(20000, 1)  # at temperature 0.5 the distribution is probs again
    draws = sample_next_token(logits, temperature=0.5, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ(model):
    def run(seed):
        config = GenerationConfig(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=seed, stop_token_ids=[])
        return [r.tokens for r in generate(model, PROMPTS, config)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_temperature_near_zero_samples_the_greedy_tokens(model):
    cold = GenerationConfig(max_new_tokens=12, temperature=1e-6, seed=0, stop_token_ids=[])
    assert [r.tokens for r in generate(model, PROMPTS, cold)] == [r.tokens for r in generate(model, PROMPTS, greedy(12))]


# --------------------------------------------------------------------------- stopping


def test_max_new_tokens_is_respected_and_reported_as_length(model):
    results = generate(model, PROMPTS, greedy(7))
    assert all(len(r.tokens) == 7 and r.finish_reason == "length" for r in results)


def test_generation_stops_at_the_tokenizer_eos_by_default(model, small_tokenizer):
    full = generate(model, [PROMPTS[0]], greedy(16))[0].tokens
    i = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    tok = copy.copy(small_tokenizer)
    tok.eos_id = full[i]  # make the i-th greedy token this model's "end of text"
    got = generate(model, [PROMPTS[0]], GenerationConfig(max_new_tokens=16, temperature=0.0), tok)[0]
    assert got.tokens == full[:i] and got.finish_reason == "stop"
    assert got.text == tok.decode(full[:i])


def test_a_stopped_row_does_not_stop_the_rest_of_the_batch(model):
    full = generate(model, PROMPTS, greedy(10))
    stop = full[1].tokens[0]
    results = generate(model, PROMPTS, greedy(10, stop_token_ids=[stop]))
    assert results[1].tokens == [] and results[1].finish_reason == "stop"
    for r, f in zip(results, full):
        expected = f.tokens[: f.tokens.index(stop)] if stop in f.tokens else f.tokens
        assert r.tokens == expected


@pytest.mark.parametrize("length", [3, 15], ids=["short", "spans-tokens"])
def test_stop_string_cuts_the_text_and_sets_the_finish_reason(model, small_tokenizer, length):
    full = generate(model, [PROMPTS[0]], greedy(20), small_tokenizer)[0]
    start = len(small_tokenizer.decode(full.tokens[:6]))
    stop = full.text[start : start + length]
    assert len(stop) == length
    got = generate(model, [PROMPTS[0]], greedy(20, stop=["never appears \x00", stop]), small_tokenizer)[0]
    assert got.finish_reason == "stop"
    assert got.text == full.text[: full.text.find(stop)]
    assert len(got.tokens) < 20 and got.tokens == full.tokens[: len(got.tokens)]


def test_stop_strings_without_a_tokenizer_are_refused(model):
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(model, PROMPTS, greedy(4, stop=["x"]))


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused(model):
    with pytest.raises(ValueError, match="max_seq_len 128"):
        generate(model, [[0] * 100], greedy(40))


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[0, 1], []], greedy(4))


def test_release_decoding_view_drops_the_cached_copy_of_the_weights():
    from lmforge.model.generate import _fused_views, release_decoding_view

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, ffn_hidden=64, max_seq_len=32)).eval()
    generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2, temperature=0.0, stop_token_ids=[]))
    assert model in _fused_views
    release_decoding_view(model)
    assert model not in _fused_views
