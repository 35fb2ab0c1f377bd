"""Self-speculative decoding with the model's MTP modules: the same tokens (and log-probabilities) as
greedy decoding, token for token, whatever the drafts; drafts accepted once the modules have learnt."""

from __future__ import annotations

import pytest
import torch

from lmforge.inference.engine import Engine, GenerationConfig, Request, generate
from lmforge.model import families
from lmforge.objectives.clm import CausalLMObjective
from lmforge.train.step import StepRunner

MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           moe=dict(n_experts=4, n_experts_per_token=2, first_dense_layers=1))
GREEDY = GenerationConfig(max_new_tokens=30, temperature=0, stop_token_ids=[])
PROMPTS = [[1, 5, 9, 3], [2], [7, 7, 7, 7, 7, 8, 9, 10, 11, 12]]


def tiny(family: str, depth: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = families.model_config(dict(family=family, vocab_size=61, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                                     mtp=dict(depth=depth), **(MLA if family == "deepseek_v3" else {})))
    return families.build(cfg)


def cycle_model(depth: int) -> tuple[torch.nn.Module, list[int]]:
    """A model (and its MTP modules) trained for 120 steps on windows of one repeating 9-token cycle."""
    model = tiny("llama", depth)
    cycle = torch.randperm(58)[:9] + 3
    stream = cycle.repeat(40)
    runner = StepRunner(model, CausalLMObjective(), torch.optim.Adam(model.parameters(), lr=1e-2), "fp32", grad_clip=1.0)
    model.train()
    for _ in range(120):
        starts = torch.randint(0, len(stream) - 25, (8,))
        runner.run_step([torch.stack([stream[s : s + 25] for s in starts])])
    return model.eval(), cycle.tolist()


def drafted(model, prompts, draft_tokens: int, config: GenerationConfig = GREEDY, **engine) -> tuple[list, list[int]]:
    eng = Engine(model, max_batch=1, draft_tokens=draft_tokens, **engine)
    ids = [eng.submit(Request(p, config)) for p in prompts]
    results = dict(eng.run())
    return [results[i][0] for i in ids], eng.draft_stats


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_drafting_with_untrained_modules_gives_the_greedy_tokens(family):
    model = tiny(family, depth=3).eval()
    base = generate(model, PROMPTS, GREEDY)
    for d in (1, 3):
        spec, (proposed, _) = drafted(model, PROMPTS, d)
        assert [g.tokens for g in spec] == [g.tokens for g in base]
        for a, b in zip(spec, base):  # verified in one forward rather than a token at a time: float32's order of sums
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert proposed > 0


def test_drafting_with_trained_modules_is_accepted_and_exact():
    model, cycle = cycle_model(depth=2)
    prompts = [cycle[:4], cycle[3:9] + cycle[:2], [1, 2] + cycle[:3]]
    base = generate(model, prompts, GREEDY)
    assert base[0].tokens[:9] == (cycle[4:] + cycle)[:9]  # the model has learnt the cycle
    for d in (1, 2):
        spec, (proposed, accepted) = drafted(model, prompts, d)
        assert [g.tokens for g in spec] == [g.tokens for g in base]
        assert accepted / proposed > 0.6, (d, proposed, accepted)
    # a stop token and max_new_tokens inside an accepted run of drafts end the row where greedy decoding does
    stop = GenerationConfig(max_new_tokens=30, temperature=0, stop_token_ids=[cycle[7]])
    short = GenerationConfig(max_new_tokens=5, temperature=0, stop_token_ids=[], top_logprobs=2)
    for config in (stop, short):
        spec, _ = drafted(model, prompts, 2, config)
        want = generate(model, prompts, config)
        assert [(g.tokens, g.finish_reason, g.stop_token is None) for g in spec] == \
            [(g.tokens, g.finish_reason, g.stop_token is None) for g in want]
        assert [[t for t, _ in alt] for g in spec for alt in (g.top_logprobs or [])] == \
            [[t for t, _ in alt] for g in want for alt in (g.top_logprobs or [])]
    # the same with the quantised cache (the drafts' cache too)
    spec, _ = drafted(model, prompts, 2, kv_cache_dtype="int8")
    assert [g.tokens for g in spec] == [g.tokens for g in generate(model, prompts, GREEDY, kv_cache_dtype="int8")]


def test_drafting_is_refused_where_it_cannot_verify():
    model = tiny("llama", depth=1).eval()
    with pytest.raises(ValueError, match="at least 2 multi-token prediction modules"):
        Engine(model, max_batch=1, draft_tokens=2)
    with pytest.raises(ValueError, match="max_batch must be 1"):
        Engine(model, max_batch=4, draft_tokens=1)
    with pytest.raises(ValueError, match="temperature 0"):
        Engine(model, max_batch=1, draft_tokens=1).submit(Request([1, 2], GenerationConfig(max_new_tokens=8, temperature=0.7)))
    with pytest.raises(ValueError, match="multi-token prediction modules"):
        Engine(tiny("llama", depth=0).eval(), max_batch=1, draft_tokens=1)
