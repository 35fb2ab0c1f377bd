"""benchmarks/long_context.py: its perplexity buckets and passkey scores against closed forms,
and its quick mode end to end (the recipes of recipes/long_context/ on a tiny model, the JSON,
the plot and the docs' table)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lmforge.data.tokenizer import TokenizerConfig, train_tokenizer
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from tests.conftest import REPO, benchmark_docs_writer, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = REPO / "benchmarks" / "long_context.py"
sys.path.append(str(SCRIPT.parent))  # its `from record import ...`, as when it runs as a script
bench = load_script(SCRIPT, "long_context_bench")

ROPES = {
    "none": {},
    "linear": {"rope_scaling": "linear", "rope_factor": 4.0},
    "dynamic": {"rope_scaling": "dynamic", "rope_factor": 4.0, "rope_original_max_seq_len": 16},
    "yarn": {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 16},
}


def tiny_model(vocab: int = 64, max_seq_len: int = 64, **rope) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=max_seq_len, **rope)
    return Transformer(cfg).eval()


class Uniform(torch.nn.Module):
    """Equal logits for every token at every position."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens, positions=None, attn_mask=None):
        return torch.zeros(*tokens.shape, self.vocab)


class KnowsTheKey(torch.nn.Module):
    """All the probability on the true key's next token wherever a key token is predicted: after
    the context (its last position) and after each key token, which it finds by the context the row
    begins with."""

    def __init__(self, vocab: int, trials: list[dict]):
        super().__init__()
        self.vocab = vocab
        self.answers = {tuple(t["context"]): t["continuations"][0] for t in trials}

    def forward(self, tokens, positions=None, attn_mask=None):
        logits = torch.zeros(*tokens.shape, self.vocab)
        for row in range(tokens.shape[0]):
            [(P, answer)] = [(len(c), a) for c, a in self.answers.items() if tuple(tokens[row, : len(c)].tolist()) == c]
            for i, q in enumerate(positions[row].tolist()):
                if P - 1 <= q < P - 1 + len(answer):
                    logits[row, i, answer[q - P + 1]] = 100.0
        return logits


@pytest.fixture(scope="module")
def digit_tokenizer(corpus_texts):
    """A tokenizer of one token per digit, as the demo's (digit_group: 1)."""
    return train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=512, digit_group=1))


def test_bucket_perplexity_is_exp_of_the_mean_nll_of_the_predictions_at_its_positions():
    model = tiny_model()
    torch.manual_seed(1)
    windows = torch.randint(0, 64, (3, 65))
    nll = bench.position_nll(model, windows, batch_size=2)
    with torch.no_grad():
        logp = torch.log_softmax(model(windows[:, :-1]).float(), dim=-1)
    by_hand = -logp.gather(2, windows[:, 1:, None])[..., 0]  # -log p(token t+1 | tokens 0..t)
    assert torch.allclose(nll, by_hand, atol=1e-5)
    got = bench.bucket_perplexity(nll, buckets=((0, 16), (16, 32), (32, 64)))
    for (lo, hi), name in [((0, 16), "0-16"), ((16, 32), "16-32"), ((32, 64), "32-64")]:
        assert got[name] == pytest.approx(math.exp(float(by_hand[:, lo:hi].mean())), rel=1e-5)


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity_in_every_bucket():
    windows = torch.randint(0, 50, (2, 1025))
    got = bench.bucket_perplexity(bench.position_nll(Uniform(50), windows))
    assert got.keys() == {"0-256", "256-512", "512-1024"}
    assert all(v == pytest.approx(50, rel=1e-5) for v in got.values())


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_packed_continuations_score_as_the_context_plus_each_continuation_alone(rope):
    model = tiny_model(**ROPES[rope])
    torch.manual_seed(2)
    context = torch.randint(0, 64, (30,)).tolist()  # past the original 16: dynamic NTK's base grows
    continuations = [torch.randint(0, 64, (n,)).tolist() for n in (3, 1, 5, 3)]
    [packed] = bench.continuation_scores(model, [(context, continuations)])
    for cont, (score, greedy) in zip(continuations, packed):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([context + cont])).float()[0], dim=-1)
        steps = logp[len(context) - 1: len(context) - 1 + len(cont)]
        alone = float(steps.gather(1, torch.tensor(cont)[:, None]).sum())
        assert score == pytest.approx(alone, abs=1e-4)
        assert greedy == bool((steps.argmax(-1) == torch.tensor(cont)).all())


def test_prompts_of_one_shape_are_batched_with_the_same_scores_as_alone():
    model = tiny_model()
    torch.manual_seed(3)
    prompts = [(torch.randint(0, 64, (12,)).tolist(), [torch.randint(0, 64, (2,)).tolist() for _ in range(3)])
               for _ in range(3)]
    together = bench.continuation_scores(model, prompts, batch_size=3)
    alone = [bench.continuation_scores(model, [p])[0] for p in prompts]
    for a, b in zip(together, alone):
        assert [s for s, _ in a] == pytest.approx([s for s, _ in b], abs=1e-5)


def test_a_passkey_prompt_has_the_length_asked_and_its_needle_at_the_depth_of_the_filler(digit_tokenizer):
    tok = digit_tokenizer
    intro, needle = tok.encode(bench.INTRO), tok.encode(bench.NEEDLE.format(key="71432"))
    sentence = max(len(tok.encode(s)) for s in bench.FILLER)
    for length in (192, 256, 512):
        for depth in (0.1, 0.5, 0.9):
            context, answer, needle_at = bench.passkey_prompt(tok, "71432", depth, length)
            assert len(context) + len(answer) == length and context[0] == tok.bos_id
            assert context[needle_at: needle_at + len(needle)] == needle
            assert tok.decode(answer).strip() == "71432" and tok.decode(context).endswith(bench.QUESTION)
            filler = len(context) - 1 - len(intro) - len(needle) - len(tok.encode(bench.QUESTION))
            before = needle_at - 1 - len(intro)  # filler tokens before the needle, cut at a sentence's end
            assert abs(before - depth * filler) <= sentence / 2 + 1


def test_a_model_that_puts_all_mass_on_the_key_scores_every_trial_and_a_uniform_one_none(digit_tokenizer):
    trials = bench.passkey_trials(digit_tokenizer, lengths=(192, 256), depths=(0.1, 0.5, 0.9), keys=2)
    assert len(trials) == 12 and all(len(t["continuations"]) == 10 for t in trials)
    assert all(len(set(map(tuple, t["continuations"]))) == 10 for t in trials)  # ten different keys
    vocab = digit_tokenizer.vocab_size
    perfect = bench.passkey_accuracy(KnowsTheKey(vocab, trials), trials)
    assert perfect["passkey"] == {"192": 1.0, "256": 1.0} and perfect["passkey_greedy"] == {"192": 1.0, "256": 1.0}
    assert perfect["passkey_by_depth"]["256"] == {"0.1": 1.0, "0.5": 1.0, "0.9": 1.0}
    # every key equally likely: no trial is won (a tie is not a retrieval)
    assert bench.passkey_accuracy(Uniform(vocab), trials)["passkey"] == {"192": 0.0, "256": 0.0}


class MergesDoubleZeros:
    """A byte-level tokenizer that also has one token for "00": keys of five digits may then take 5 or 6 tokens."""

    bos_id = 256

    def encode(self, text: str) -> list[int]:
        out, data, i = [], text.encode(), 0
        while i < len(data):
            if data[i: i + 2] == b"00":
                out.append(257)
                i += 2
            else:
                out.append(data[i])
                i += 1
        return out


def test_keys_of_different_token_counts_are_refused_not_ranked():
    with pytest.raises(ValueError, match="encode to different numbers of tokens"):
        bench.passkey_trials(MergesDoubleZeros(), lengths=(512,), depths=(0.5,), keys=50)


def test_quick_mode_runs_the_recipes_scores_every_model_and_writes_the_docs_table(tmp_path):
    results = REPO / "benchmarks" / "results" / "long_context.json"
    before = results.stat().st_mtime_ns if results.exists() else None
    out, plot = tmp_path / "long_context.json", tmp_path / "long_context.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(SCRIPT), "--quick", "--runs", str(tmp_path / "runs"), "--out", str(out), "--plot", str(plot)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["method"], r["trained"]) for r in result["rows"]] == [
        ("none", False), ("dynamic NTK", False), ("PI", False), ("PI", True), ("NTK", False), ("NTK", True),
        ("YaRN", False), ("YaRN", True)]
    for r in result["rows"]:
        assert r["perplexity"].keys() == {"0-256", "256-512", "512-1024"}
        assert all(math.isfinite(v) and v > 1 for v in r["perplexity"].values())
        assert r["passkey"].keys() == {"256", "512", "1024"} and all(0 <= v <= 1 for v in r["passkey"].values())
    assert {r["rope"].get("rope_scaling") for r in result["rows"]} == {None, "dynamic", "linear", "yarn"}
    assert set(result["training"]) == {"pretrain", "extend_pi", "extend_ntk", "extend_yarn"}
    assert result["training"]["extend_yarn"]["seq_len"] == 1024 and result["config"]["quick"] is True
    assert result["date"] and result["commit"] and result["command"].startswith("python benchmarks/long_context.py")
    assert result["machine"]["cpu"] and "load_average_1_5_15_min" in result["machine"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the docs' table of it, as scripts/write_benchmark_docs.py writes it
    table = "\n".join(benchmark_docs_writer().render("long_context", result).lines)
    assert "| YaRN | 2 steps at 1024 |" in table and "| none | none (zero-shot) |" in table
    assert (results.stat().st_mtime_ns if results.exists() else None) == before
