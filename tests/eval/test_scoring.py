"""The three requests on a model: log-likelihoods equal a plain forward's, batching and order
change nothing, rolling windows cover long texts, sampled generation is seeded per request."""

from __future__ import annotations

import pytest
import torch

from lmforge.eval.scoring import (
    encode_pair,
    generate_until,
    generation_config,
    load_checkpoint,
    loglikelihood_pairs,
    loglikelihood_rolling,
)


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return load_checkpoint(str(tiny_checkpoint), "cpu")


def direct_logprob(model, ids: list[int], start: int) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(start, len(ids))))


def test_trailing_spaces_of_the_context_move_to_the_continuation(lm):
    _, tok = lm
    assert encode_pair(tok, "Answer: ", "yes") == encode_pair(tok, "Answer:", " yes")
    assert encode_pair(tok, "", "yes") == ([tok.bos_id], tok.encode("yes"))


def test_loglikelihood_is_the_forward_sum_whatever_the_batch(lm):
    model, tok = lm
    pairs = [("The river is", " wide"), ("A", " long answer of many words here"), ("Q: why?\nA:", " because")]
    alone = [loglikelihood_pairs(model, tok, [p], batch_size=1)[0] for p in pairs]
    together = loglikelihood_pairs(model, tok, pairs, batch_size=3)
    for (ll, greedy), (ll2, greedy2), (ctx, cont) in zip(alone, together, pairs):
        c, t = encode_pair(tok, ctx, cont)
        assert ll == pytest.approx(direct_logprob(model, c + t, len(c)), abs=1e-4)
        assert ll2 == pytest.approx(ll, abs=1e-4) and greedy == greedy2


def test_rolling_loglikelihood_covers_a_text_longer_than_the_context(lm, corpus_texts):
    model, tok = lm
    short = "To be, or not to be"
    ids = [tok.bos_id, *tok.encode(short)]
    assert loglikelihood_rolling(model, tok, [short])[0] == pytest.approx(direct_logprob(model, ids, 1), abs=1e-4)
    long = corpus_texts[0][:1500]
    assert len(tok.encode(long)) > 2 * model.cfg.max_seq_len
    total = loglikelihood_rolling(model, tok, [long, short], batch_size=2)
    assert total[0] < total[1] < 0 and total[1] == pytest.approx(direct_logprob(model, ids, 1), abs=1e-4)


def test_sampled_generation_is_seeded_per_request_not_per_batch(lm):
    model, tok = lm
    kwargs = {"until": ["\n"], "max_gen_toks": 5, "do_sample": True, "temperature": 1.0}
    requests = [("Q: one\nA:", kwargs)] * 3 + [("Q: two\nA:", kwargs)]
    forward = generate_until(model, tok, requests, seed=7, batch_size=4)
    backward = generate_until(model, tok, requests[::-1], seed=7, batch_size=1)
    assert backward == [forward[3], *forward[:3]]  # the k-th copy of a request draws its k-th sample
    assert len(set(forward[:3])) > 1  # three samples of one prompt differ
    assert generate_until(model, tok, requests, seed=8, batch_size=4) != forward
    greedy = generate_until(model, tok, [("Q: one\nA:", {"until": ["\n"], "max_gen_toks": 5})] * 2)
    assert greedy[0] == greedy[1]


@pytest.mark.parametrize("kwargs,key", [
    ({"temperature": -1.0, "do_sample": True}, "temperature"),  # was decoded greedily, unasked
    ({"until": 5}, "until"),
    ({"max_gen_toks": "32"}, "max_gen_toks"),
    ({"top_p": 0.0, "temperature": 1.0}, "top_p"),
])
def test_generation_kwargs_out_of_range_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"generation_kwargs\.{key} must be"):
        generation_config(kwargs, "<eos>")


def test_generation_kwargs_in_range_give_the_engine_config():
    config, stops = generation_config({"until": "\n", "temperature": 0.5, "do_sample": True, "max_gen_toks": 7}, "<eos>")
    assert (config.temperature, config.max_new_tokens, stops) == (0.5, 7, ["\n", "<eos>"])
    assert generation_config({"temperature": 0.5, "do_sample": False}, "<eos>")[0].temperature == 0.0
