"""benchmarks/kv_cache.py: its perplexity against a closed form, and its rows (bytes per token
from the shapes, every row kind, the MLA row's latent cache) rendered into the docs' table."""

from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch

from lmforge.model.config import ModelConfig
from lmforge.model.families import build, model_config
from lmforge.model.transformer import Transformer
from tests.conftest import REPO, benchmark_docs_writer, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = REPO / "benchmarks" / "kv_cache.py"
sys.path.append(str(SCRIPT.parent))  # its `from record import ...`, as when it runs as a script
bench = load_script(SCRIPT, "kv_cache_bench")


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=2, max_seq_len=32, **kw)).eval()


@pytest.mark.parametrize("kind", bench.STORAGE)
def test_a_uniform_model_has_the_vocabulary_size_as_perplexity_under_every_cache(kind):
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each next token has probability 1/96
    windows = torch.randint(0, 96, (3, 33), generator=torch.Generator().manual_seed(0))
    assert bench.perplexity(bench.window_logprobs(model, windows, kind, batch=2), windows) == pytest.approx(96, rel=1e-5)


def test_the_divergence_is_zero_against_itself_and_the_kl_of_two_known_distributions():
    p = torch.log(torch.tensor([[[0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.25, 0.75]]]))
    assert bench.divergence(p, p) == (0.0, 0.0)
    kl, worst = bench.divergence(q, p)  # KL(p || q) = 0.5 ln 2 + 0.5 ln (2/3)
    assert kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3)) and worst == pytest.approx(math.log(2))


def test_the_rows_count_bytes_from_the_shapes_and_render_every_kind():
    model = tiny()
    windows = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(0))
    args = argparse.Namespace(window=8, batch=2, new_tokens=2, repeats=1)
    gqa = tiny(n_kv_heads=1)
    mla = build(model_config(dict(family="deepseek_v3", vocab_size=96, d_model=64, n_layers=2, n_heads=2, max_seq_len=32,
                                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=32,
                                  moe={"first_dense_layers": 2}))).eval()
    rows = {r["name"]: r for r in bench.rows_of(model, windows, args, gqa, mla)}
    d = model.cfg.head_dim  # 32: one int4 group
    assert [r["kind"] for r in rows.values()] == ["storage"] * 4 + ["gqa", "sliding_window", "latent"]
    assert rows["fp32"]["bytes_vs_bf16"] == 2.0 and rows["GQA, 1 KV head of 2"]["bytes_vs_bf16"] == 0.5
    assert rows["int8"]["bytes_per_token"] == 2 * 2 * 2 * (d + 4)
    assert rows["int4"]["bytes_per_token"] == 2 * 2 * 2 * (d // 2 + 8)
    assert rows["sliding window 8"]["capacity"] == 8 and rows["sliding window 8"]["cache_bytes_at_context"] == 8 * 2 * 2 * 2 * 2 * d
    # a latent of 64/4 and a RoPE key of 32/4 per layer, bf16: against MHA's 2 x 64
    assert rows["MLA latent cache"]["bytes_per_token"] == 2 * (16 + 8) * 2 and rows["MLA latent cache"]["bytes_vs_bf16"] == 0.1875
    # the GQA and MLA rows score their own models: a perplexity, no divergence from another model's fp32 cache
    for name in ("GQA, 1 KV head of 2", "MLA latent cache"):
        assert rows[name]["perplexity"] > 1 and rows[name]["kl_to_fp32"] is None and rows[name]["decode_tokens_per_s"] > 0
    assert rows["fp32"]["perplexity"] == pytest.approx(rows["bf16"]["perplexity"], rel=1e-2)
    assert rows["fp32"]["kl_to_fp32"] == 0 and 0 < rows["int8"]["kl_to_fp32"] < rows["int4"]["kl_to_fp32"]
    result = {"model": {"n_layers": 2, "n_heads": 2, "head_dim": d, "params": 1, "vocab_size": 96, "steps": 1,
                        "val_loss": 4.0}, "context": 32, "windows": 2,
              "decode": {"batch": 2, "new_tokens": 2, "repeats": 1, "threads": 1}, "load_average": [1.0, 1.0],
              "rows": list(rows.values())}
    lines = "\n".join(benchmark_docs_writer().render_kv_cache(result).lines)
    assert all(f"| {name} |" in lines for name in rows)
