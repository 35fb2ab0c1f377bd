"""The generation engine: cached decoding computes what a full recompute computes, padding
keeps batch rows apart, finished rows leave and queued requests take their slots, every
token's log-probability is the training forward's, and stopping works."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from lmforge.inference.engine import (
    Engine,
    GenerationConfig,
    Request,
    decode_step,
    decoding_view,
    generate,
    prefill,
)
from lmforge.inference.sampling import min_p_filter, repetition_penalty, sample_next_token, top_k_filter, top_p_filter
from lmforge.model.config import ModelConfig
from lmforge.model.fused import PackedLinear, fused_copy, onednn_packs
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.transformer import Transformer
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


CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_packs(torch.float32, CPU), reason="this torch has no oneDNN")
LAYOUTS = {"modules": lambda m: m, "fused": lambda m: fused_copy(m, pack=False),
           "fused-packed": lambda m: fused_copy(m, pack=True)}
LAYOUT_PARAMS = [pytest.param(name, marks=needs_onednn if name == "fused-packed" else ()) for name in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@torch.no_grad()
def test_cached_decoding_gives_the_logits_of_a_full_recompute(model, layout):
    net = LAYOUTS[layout](model)
    prompt = PROMPTS[0]
    batch = prefill(net, [prompt], extra=10)
    seq = list(prompt)
    for _ in range(10):
        torch.testing.assert_close(batch.logits[0], full_logits(model, seq), atol=1e-5, rtol=0)
        token = int(batch.logits[0].argmax())
        seq.append(token)
        decode_step(net, torch.tensor([token]), batch)


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@torch.no_grad()
def test_each_row_of_a_left_padded_batch_gets_the_logits_of_its_prompt_alone(model, layout):
    net = LAYOUTS[layout](model)
    feed = torch.randint(3, 512, (len(PROMPTS), 8), generator=torch.Generator().manual_seed(0))
    batch = prefill(net, PROMPTS, extra=8)
    assert batch.key_mask is not None  # lengths differ, so the batch is padded
    for step in range(8):
        for row, prompt in enumerate(PROMPTS):
            alone = full_logits(model, prompt + feed[row, :step].tolist())
            torch.testing.assert_close(batch.logits[row], alone, atol=1e-5, rtol=0)
        decode_step(net, feed[:, step], batch)


@torch.no_grad()
def test_a_multi_token_step_after_a_cached_prefix_is_causal(model):
    tokens = torch.tensor([PROMPTS[0]])
    cache = model.new_kv_cache(1, tokens.shape[1], torch.float32, "cpu")
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


def hf_llama(model: Transformer) -> nn.Module:
    """transformers' Llama holding ``model``'s weights."""
    import transformers
    d = {k: v for k, v in hf_config_dict(model.cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d)).eval()
    missing, unexpected = hf.load_state_dict(state_dict_to_hf(model.state_dict(), model.cfg), strict=False)
    assert not missing and not unexpected
    return hf


def test_greedy_continuation_equals_transformers_generate(model):
    hf = hf_llama(model)
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
    assert prefill(decoding_view(bf16), PROMPTS, 6).cache.tensors["k"].dtype == torch.bfloat16


# --------------------------------------------------------------------------- the decoding layout


@needs_onednn
def test_the_fused_copy_shares_the_model_and_leaves_it_unchanged(model):
    keys = list(model.state_dict())
    fused = fused_copy(model, pack=True)
    assert list(model.state_dict()) == keys  # checkpoints, HF export and LoRA targets keep wq/wk/wv/w1/w3
    assert model.layers[0].attn.wqkv is None and model.layers[0].attn.wq is not None
    assert fused.embed.weight is model.embed.weight and fused.layers[0].attn_norm.weight is model.layers[0].attn_norm.weight
    assert type(fused.layers[0].attn.wqkv) is PackedLinear and fused.layers[0].attn.wq is None
    assert type(fused.layers[0].mlp.w13) is PackedLinear and type(fused.lm_head) is PackedLinear
    assert fused.rope_pairs and not model.rope_pairs  # q/k rows in rotation-pair order in the copy only
    assert type(fused) is type(model) and type(fused).forward is type(model).forward  # one forward


def test_decoding_view_is_reused_until_a_parameter_changes():
    torch.manual_seed(2)
    model = Transformer(ModelConfig(**CFG)).eval()
    view = decoding_view(model)
    assert isinstance(view, Transformer) and view is not model and decoding_view(model) is view
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
    # 16-bit matrices stay 16-bit, packed where this CPU's oneDNN has 16-bit kernels
    packed = onednn_packs(torch.bfloat16, CPU)
    wqkv = bf16_view.layers[0].attn.wqkv
    assert (wqkv.weight_packed if packed else wqkv.weight).dtype == torch.bfloat16
    assert type(bf16_view.lm_head) is (PackedLinear if packed else nn.Linear)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_a_16_bit_decoding_view_computes_the_16_bit_models_logits(dtype):
    torch.manual_seed(3)
    model = Transformer(ModelConfig(**{**CFG, "qkv_bias": True, "qk_norm": True, "tie_embeddings": True})).eval()
    low = copy.deepcopy(model).to(dtype)
    view = decoding_view(low)
    tokens = torch.tensor([PROMPTS[0]])
    logits, reference = view(tokens), low(tokens)
    assert logits.dtype == dtype
    # joined matrices compute the same dot products, each rounded once to 16 bits
    torch.testing.assert_close(logits.float(), reference.float(), atol=0.05, rtol=0.02)
    batch = prefill(view, [PROMPTS[0]], extra=2)
    assert batch.cache.tensors["k"].dtype == dtype
    # the cached pass keeps the 16-bit attention kernel, the full pass upcasts (``attend``): 16-bit rounding apart
    torch.testing.assert_close(batch.logits[0].float(), logits[0, -1].float(), atol=0.02, rtol=0.02)


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
    from lmforge.inference.engine import _decoding_models, release_decoding_view

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, ffn_hidden=64, max_seq_len=32)).eval()
    generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2, temperature=0.0, stop_token_ids=[]))
    assert model in _decoding_models
    release_decoding_view(model)
    assert model not in _decoding_models


# --------------------------------------------------------------------------- the engine: rows leave, queues, n, log-probs


def training_logprobs(model: Transformer, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) from one training forward in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]))[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_a_finished_row_leaves_the_batch_and_is_not_computed_again(model):
    full = generate(model, PROMPTS, greedy(10))
    stop = full[1].tokens[2]
    engine = Engine(model)
    for p in PROMPTS:
        engine.submit(Request(p, greedy(10, stop_token_ids=[stop])))
    sizes = []
    calls = []
    hook = engine.net.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    while engine.queue or engine.rows:
        engine.step()
        sizes.append(len(engine.rows))
        if engine.batch is not None:
            assert engine.batch.cache.batch == engine.batch.logits.shape[0] == len(engine.rows)
    hook.remove()
    assert 2 in sizes  # row 1 left after its stop token, the others went on
    assert calls.count(3) <= full[1].tokens.index(stop) + 1  # the 3-row batch ran only until row 1 stopped


@pytest.mark.parametrize("max_batch", [1, 2])
def test_queued_requests_take_the_slots_of_finished_rows_and_decode_as_alone(model, max_batch):
    prompts = PROMPTS + [[0, 5, 6], [0, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412]]
    configs = [greedy(n) for n in (3, 12, 7, 9, 5)]  # different lengths, so rows finish at different steps
    engine = Engine(model, max_batch=max_batch)
    ids = [engine.submit(Request(p, c)) for p, c in zip(prompts, configs)]
    order, results = [], {}
    for request_id, gens in engine.run():
        order.append(request_id)
        results[request_id] = gens[0]
        assert len(engine.rows) <= max_batch
    assert sorted(order) == ids and order != ids or max_batch == 1  # finished as they finish, not in order
    for i, (p, c) in enumerate(zip(prompts, configs)):
        assert results[ids[i]].tokens == generate(model, [p], c)[0].tokens


def test_logprobs_equal_the_training_forward_for_padded_batches_n_samples_and_joined_rows(model):
    config = GenerationConfig(max_new_tokens=9, temperature=1.0, seed=4, stop_token_ids=[], n=3, top_logprobs=4)
    for max_batch in (64, 4):  # everything at once, and rows joining a running batch
        results = generate(model, PROMPTS, config, max_batch=max_batch)
        assert len(results) == 3 * len(PROMPTS)
        for i, r in enumerate(results):
            prompt = PROMPTS[i // 3]
            assert r.prompt_tokens == prompt
            expected = training_logprobs(model, prompt, r.tokens)
            torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-5, rtol=0)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + r.tokens]))[0, len(prompt) - 1 : -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(4)
            assert [[t for t, _ in step] for step in r.top_logprobs] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([[v for _, v in step] for step in r.top_logprobs]), top.values,
                                       atol=1e-5, rtol=0)
        samples = [tuple(r.tokens) for r in results[:3]]
        assert len(set(samples)) == 3  # n samples of one prompt are drawn independently


def test_a_sample_ended_by_a_stop_token_keeps_it_and_its_logprob(model):
    stops = list(range(5, 60))  # a tenth of the vocabulary: most samples stop within 12 tokens
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=2, stop_token_ids=stops, n=4)
    results = generate(model, PROMPTS, config)
    assert {r.finish_reason for r in results} == {"stop", "length"}
    for i, r in enumerate(results):
        if r.finish_reason == "length":
            assert r.stop_token is None
            continue
        token, logprob, _ = r.stop_token
        assert token in stops and token not in r.tokens
        expected = training_logprobs(model, PROMPTS[i // 4], r.tokens + [token])[-1]
        assert abs(logprob - float(expected)) < 1e-5


def test_n_samples_share_one_prefill_of_their_prompt(model):
    engine = Engine(model)
    embedded = []  # the shape of every batch of tokens embedded: one prefill, then one row per sample per step
    hook = engine.net.embed.register_forward_hook(lambda m, args, out: embedded.append(tuple(args[0].shape)))
    engine.submit(Request(PROMPTS[0], GenerationConfig(max_new_tokens=4, n=5, seed=1, stop_token_ids=[])))
    ((_, gens),) = list(engine.run())
    hook.remove()
    assert len(gens) == 5 and embedded == [(1, len(PROMPTS[0]))] + [(5, 1)] * 3
    assert engine.batch is None


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(model):
    config = GenerationConfig(max_new_tokens=8, temperature=1.0, top_k=50, seed=11, stop_token_ids=[])
    engine = Engine(model)
    alone = engine.submit(Request(PROMPTS[0], config))
    (_, (first,)), = list(engine.run())
    engine = Engine(model, max_batch=2)
    engine.submit(Request(PROMPTS[1], GenerationConfig(max_new_tokens=3, seed=5, stop_token_ids=[])))
    mixed = engine.submit(Request(PROMPTS[0], config))
    engine.submit(Request(PROMPTS[2], GenerationConfig(max_new_tokens=6, temperature=0.0, stop_token_ids=[])))
    results = dict(engine.run())
    assert alone == 0 and results[mixed][0].tokens == first.tokens


def test_min_p_keeps_tokens_within_a_fraction_of_the_most_likely():
    import transformers
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = min_p_filter(logits, 0.1)
    theirs = transformers.MinPLogitsWarper(min_p=0.1)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))


def test_repetition_penalty_is_ctrls_as_transformers_applies_it():
    import transformers
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 5, 5, 7], [0, 2, 29, 3]])
    seen = torch.zeros(2, 30, dtype=torch.bool).scatter_(1, ids, True)
    theirs = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.3)(ids, logits.clone())
    torch.testing.assert_close(repetition_penalty(logits, seen, 1.3), theirs)


def test_a_repetition_penalty_changes_greedy_output_away_from_repeats(model):
    plain = generate(model, PROMPTS, greedy(24))
    penalized = generate(model, PROMPTS, greedy(24, repetition_penalty=5.0))
    repeats = sum(len(r.tokens) - len(set(r.tokens)) for r in plain)
    assert sum(len(r.tokens) - len(set(r.tokens)) for r in penalized) < repeats or repeats == 0
    assert [r.tokens for r in plain] != [r.tokens for r in penalized] or repeats == 0


def test_penalized_greedy_decoding_equals_transformers_as_rows_leave_and_join(model):
    # max_batch 2: the third prompt joins when the first finishes; each row's penalty must keep
    # covering its own prompt and generated tokens through the batch's select and merge
    lengths, penalty = [6, 14, 10], 1.5
    engine = Engine(model, max_batch=2)
    ids = [engine.submit(Request(p, greedy(n, repetition_penalty=penalty))) for p, n in zip(PROMPTS, lengths)]
    got = dict(engine.run())
    hf = hf_llama(model)
    for request, prompt, n in zip(ids, PROMPTS, lengths):
        tokens = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False, repetition_penalty=penalty,
                              max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=2)
        assert got[request][0].tokens == out[0, len(prompt) :].tolist()
    plain = generate(model, PROMPTS, greedy(max(lengths)))
    assert any(got[i][0].tokens != p.tokens[: len(got[i][0].tokens)] for i, p in zip(ids, plain))  # the penalty acted


def test_per_row_settings_filter_each_row_by_its_own():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.3]] * 2)
    kept = top_k_filter(logits, torch.tensor([1, 0]))
    assert torch.isfinite(kept).tolist() == [[False, True, False, False, False], [True] * 5]
    greedy_row = sample_next_token(logits, torch.tensor([0.0, 1.0]), generator=torch.Generator().manual_seed(0))
    assert int(greedy_row[0]) == 1


# --------------------------------------------------------------------------- serving: per-token callback, cancel, prompt scores


def test_on_token_sees_every_kept_token_in_order_and_never_a_stop_token(model):
    full = generate(model, PROMPTS, greedy(10))
    stop = full[0].tokens[4]
    seen: dict[int, list[tuple[int, int, float]]] = {}
    engine = Engine(model)
    ids = [engine.submit(Request(p, greedy(10, stop_token_ids=[stop], n=2),
                                 on_token=lambda s, t, lp, top, i=i: seen.setdefault(i, []).append((s, t, lp))))
           for i, p in enumerate(PROMPTS)]
    results = dict(engine.run())
    for i, request_id in enumerate(ids):
        for sample, gen in enumerate(results[request_id]):
            assert [(t, lp) for s, t, lp in seen[i] if s == sample] == list(zip(gen.tokens, gen.logprobs))
    first = results[ids[0]][0]
    assert first.finish_reason == "stop" and first.stop_token[0] == stop and stop not in first.tokens
    assert first.stop_token[1] == pytest.approx(float(training_logprobs(model, PROMPTS[0], first.tokens + [stop])[-1]),
                                                abs=1e-5)


@pytest.mark.parametrize("where", ["queued", "decoding"])
def test_a_cancelled_request_leaves_at_once_and_frees_its_slot(model, where):
    engine = Engine(model, max_batch=1)
    long = engine.submit(Request(PROMPTS[0], greedy(60)))
    short = engine.submit(Request(PROMPTS[1], greedy(5)))
    if where == "decoding":
        engine.step()
        engine.step()
        assert [r.request for r in engine.rows] == [long]
        assert engine.active == 2
    engine.cancel(long)
    assert engine.active == 1
    engine.step()
    assert {r.request for r in engine.rows} == {short}  # the freed slot took the waiting request
    results = dict(engine.run())
    assert list(results) == [short] and results[short][0].tokens == generate(model, [PROMPTS[1]], greedy(5))[0].tokens
    assert engine.active == 0 and not engine.rows and not engine.cancelled


def test_prompt_logprobs_come_from_the_prefill_and_equal_the_training_forward(model):
    engine = Engine(model)
    scored = [engine.submit(Request(p, greedy(3, prompt_logprobs=True, top_logprobs=k))) for p, k in zip(PROMPTS, [0, 2, 5])]
    plain = engine.submit(Request(PROMPTS[0], greedy(3)))
    results = dict(engine.run())
    for request_id, prompt, k in zip(scored, PROMPTS, [0, 2, 5]):
        (gen,) = results[request_id]
        expected = training_logprobs(model, prompt[:1], prompt[1:])
        torch.testing.assert_close(torch.tensor(gen.prompt_logprobs), expected, atol=1e-5, rtol=0)
        if k == 0:
            assert gen.prompt_top_logprobs is None
        else:
            with torch.no_grad():
                logits = model(torch.tensor([prompt]))[0, :-1].float()
            top = torch.log_softmax(logits, -1).topk(k, -1)
            assert [[t for t, _ in alts] for alts in gen.prompt_top_logprobs] == top.indices.tolist()
    assert results[plain][0].prompt_logprobs is None
    assert results[scored[0]][0].tokens == results[plain][0].tokens


def test_scoring_prompts_adds_no_forward_pass(model):
    def block_calls(prompt_logprobs: bool) -> int:
        engine = Engine(model)
        calls = []
        hook = engine.net.layers[0].register_forward_hook(lambda m, args, out: calls.append(1))
        for p in PROMPTS:
            engine.submit(Request(p, greedy(3, prompt_logprobs=prompt_logprobs)))
        list(engine.run())
        hook.remove()
        return len(calls)

    assert block_calls(True) == block_calls(False) == 3  # one prefill of all prompts + two decode steps


# --------------------------------------------------------------------------- one bad request among good ones


def sampled(seed: int, max_new_tokens: int = 8, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, stop_token_ids=[], **kw)


GOOD = [(PROMPTS[0], 3), (PROMPTS[1], 4), (PROMPTS[2], 5)]  # (prompt, seed) of the good requests


def alone(model, prompt, config) -> list[list[int]]:
    return [g.tokens for g in generate(model, [prompt], config)]


def run_with_failures(engine: Engine) -> tuple[dict, dict]:
    """Every finished request's generations, and every failed one's error."""
    done, failed = {}, {}
    while engine.queue or engine.rows:
        done.update(engine.step())
        failed.update(engine.take_failures())
    return done, failed


def test_a_seed_outside_the_generators_range_is_refused():
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            GenerationConfig(seed=seed)
    for seed in (2**64 - 1, -(2**63), 0):
        torch.Generator().manual_seed(GenerationConfig(seed=seed).seed)  # the ends of the range are the generator's


def test_a_prompt_token_outside_the_vocabulary_is_refused_at_submit(model):
    for bad in ([0, 512], [0, -1]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            Engine(model).submit(Request(bad, greedy(2)))


@pytest.mark.parametrize("how", ["seed", "prefill", "callback"])
def test_one_failing_request_fails_alone_and_the_others_decode_as_alone(model, how):
    # each way a request can still fail inside the engine, though submit checks it: its seed
    # when its generator is made (as 2^64 did), its prefill, its streaming callback mid-decode
    def on_token(sample, token, logprob, top):
        if how == "callback" and sample == 1:
            raise RuntimeError("the client's callback broke")

    engine = Engine(model)
    good = [engine.submit(Request(p, sampled(seed))) for p, seed in GOOD[:2]]
    prompt, config = list(PROMPTS[0]), sampled(9, n=2)
    bad = engine.submit(Request(prompt, config, on_token=on_token))
    good.append(engine.submit(Request(GOOD[2][0], sampled(GOOD[2][1]))))
    if how == "seed":
        config.seed = 2**64  # past the check, as a request that slipped through would be
    elif how == "prefill":
        prompt.append(10**6)  # an id past the embedding, past submit's check
    done, failed = run_with_failures(engine)
    assert list(failed) == [bad] and bad not in done
    assert {"seed": "Overflow", "prefill": "index out of range", "callback": "broke"}[how] in str(failed[bad])
    for request_id, (p, seed) in zip(good, GOOD):
        assert [g.tokens for g in done[request_id]] == alone(model, p, sampled(seed))
    assert not engine.rows and not engine.done and engine.batch is None


def test_a_request_failing_mid_decode_frees_its_rows_for_the_next_in_the_queue(model):
    calls = []

    def breaks(sample, token, logprob, top):
        calls.append(token)
        if len(calls) == 3:  # the second step's first token
            raise RuntimeError("gone")

    engine = Engine(model, max_batch=2)
    bad = engine.submit(Request(PROMPTS[0], sampled(1, 20, n=2), on_token=breaks))
    waiting = engine.submit(Request(PROMPTS[1], sampled(4)))  # needs the two rows the bad one holds
    engine.step()
    assert len(engine.rows) == 2 and engine.queue
    done, failed = run_with_failures(engine)
    assert list(failed) == [bad] and [g.tokens for g in done[waiting]] == alone(model, PROMPTS[1], sampled(4))


def test_run_raises_a_failed_requests_error_for_a_caller_in_process(model):
    engine = Engine(model)
    config = sampled(1)
    engine.submit(Request(PROMPTS[0], config))
    config.seed = 2**64
    with pytest.raises(ValueError, match="Overflow"):
        list(engine.run())


# --------------------------------------------------------------------------- sliding windows: a ring cache


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_decoding_three_windows_keeps_the_cache_at_the_window_and_the_training_forwards_logprobs(positions):
    """Every layer windowed: the cache is a ring of ``sliding_window`` slots however long decoding runs, while
    rows of different lengths (one prompt longer than the window) leave and join a running batch."""
    window = 8
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**CFG, "n_layers": 3}, sliding_window=window, positions=positions)).eval()
    prompts = [PROMPTS[0] + [33, 34], [0, 250, 3], PROMPTS[2], [0, 5]]  # 13, 3, 7 and 2 tokens
    configs = [greedy(3 * window), greedy(5), greedy(2 * window), greedy(3 * window + 1)]
    engine = Engine(model, max_batch=2)
    ids = [engine.submit(Request(p, c)) for p, c in zip(prompts, configs)]
    results, capacities = {}, set()
    while engine.queue or engine.rows:
        for request_id, gens in engine.step():
            results[request_id] = gens[0]
        if engine.batch is not None:
            capacities.add(engine.batch.cache.capacity)
    assert capacities == {window}  # never more than the window, though rows reach 3 windows past their prompt
    for i, (prompt, config) in enumerate(zip(prompts, configs)):
        got = results[ids[i]]
        assert len(got.tokens) == config.max_new_tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), training_logprobs(model, prompt, got.tokens),
                                   atol=1e-5, rtol=0)


def test_a_model_with_some_full_layers_keeps_every_position_and_decodes_as_a_full_recompute():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG, sliding_window=4, layer_types=["sliding_attention", "full_attention"])).eval()
    results = generate(model, PROMPTS, greedy(12), max_batch=2)
    for prompt, got in zip(PROMPTS, results):
        torch.testing.assert_close(torch.tensor(got.logprobs), training_logprobs(model, prompt, got.tokens),
                                   atol=1e-5, rtol=0)
    assert prefill(model, PROMPTS, 12).cache.capacity == len(PROMPTS[0]) + 12
