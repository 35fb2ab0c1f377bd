"""Quality scores: the hashed n-gram classifier, perplexity under an lmforge model, and their cuts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.core.io import InputError
from lmforge.curate.quality import (
    ClassifierConfig,
    ClassifierScore,
    HashedNgramClassifier,
    PerplexityConfig,
    PerplexityScore,
    TrainClassifierConfig,
    document_nll,
    train_classifier,
)
from lmforge.data.documents import Document
from lmforge.data.tokenizer import token_byte_lengths
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from tests.conftest import write_jsonl

GOOD = "the river flows past the old mill where the miller grinds the golden wheat every autumn morning".split()
BAD = "click here buy now cheap pills free casino bonus win money fast limited offer subscribe".split()


def sequential(fn, items):
    return [fn(x) for x in items]


def run_cut(step, shards: list[list[Document]], work_dir) -> list[str | None]:
    for i, docs in enumerate(shards):
        step.index_shard(i, docs, work_dir)
    step.resolve(work_dir, len(shards), sequential)
    return [d for i, docs in enumerate(shards) for d in step.apply_shard(i, docs, work_dir)]


def toy_text(vocab: list[str], rng: np.random.Generator, n: int = 30) -> str:
    return " ".join(rng.choice(vocab, size=n))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    records = [{"text": toy_text(GOOD, rng), "label": 1} for _ in range(150)]
    records += [{"text": toy_text(BAD, rng), "label": False} for _ in range(150)]
    tmp = tmp_path_factory.mktemp("classifier")
    data = write_jsonl(tmp / "labelled.jsonl", [records[i] for i in rng.permutation(len(records))])
    result = train_classifier(TrainClassifierConfig(data=[str(data)], output=str(tmp / "model"), hash_bits=16))
    assert result["validation"]["examples"] == 30
    assert result["validation"]["accuracy"] == 1.0
    return tmp / "model"


def test_classifier_learns_a_separable_task(classifier_dir):
    model = HashedNgramClassifier.load(classifier_dir)
    rng = np.random.default_rng(1)
    good = model.score([toy_text(GOOD, rng) for _ in range(20)])
    bad = model.score([toy_text(BAD, rng) for _ in range(20)])
    assert good.min() > 0.9 and bad.max() < 0.1
    assert 0.1 < model.score(["zebra quokka"])[0] < 0.9  # unseen words: near the prior
    meta = json.loads((classifier_dir / "classifier.json").read_text())
    assert meta["validation"]["accuracy"] == 1.0 and meta["hash_bits"] == 16


def test_classifier_step_threshold_rejects_exactly_the_low_scores(classifier_dir, tmp_path):
    rng = np.random.default_rng(2)
    shards = [[Document(f"{kind}{s}-{i}", toy_text(GOOD if kind == "good" else BAD, rng))
               for i in range(5) for kind in ("good", "bad")] for s in range(3)]
    step = ClassifierScore(ClassifierConfig(model=str(classifier_dir), threshold=0.5))
    decisions = run_cut(step, shards, tmp_path)
    docs = [d for shard in shards for d in shard]
    for doc, decision in zip(docs, decisions):
        score = doc.metadata["classifier_score"]
        assert (decision is not None) == doc.id.startswith("bad") == (score < 0.5)
        if decision:
            assert decision == "classifier_score < 0.5 (threshold)"


@pytest.mark.parametrize("percentile", [10, 35, 50, 90])
@pytest.mark.parametrize("reject_above", [False, True])
def test_percentile_cut_rejects_exactly_the_right_documents(percentile, reject_above, tmp_path, classifier_dir):
    rng = np.random.default_rng(percentile)
    scores = rng.uniform(1, 100, size=47)
    docs = [Document(f"d{i}", "text", {"planted": float(s)}) for i, s in enumerate(scores)]
    shards = [docs[:10], docs[10:11], docs[11:]]
    if reject_above:
        step = PerplexityScore(PerplexityConfig(checkpoint="unused", percentile=percentile))
    else:
        step = ClassifierScore(ClassifierConfig(model=str(classifier_dir), percentile=percentile))
    step.score_documents = lambda ds: np.array([d.metadata["planted"] for d in ds])
    decisions = run_cut(step, shards, tmp_path)
    cut = np.percentile(scores, percentile)
    expected = scores > cut if reject_above else scores < cut
    assert [d is not None for d in decisions] == expected.tolist()
    assert abs(sum(expected) - len(scores) * (1 - percentile / 100 if reject_above else percentile / 100)) <= 1
    name = step.name
    for doc, decision in zip(docs, decisions):
        assert doc.metadata[f"{name}_score"] == pytest.approx(doc.metadata["planted"])
        if decision:
            assert decision.startswith(f"{name}_score {'>' if reject_above else '<'} {cut:.6g} (")
            assert "percentile)" in decision


def test_training_data_errors_name_the_file_and_line(tmp_path):
    good = {"text": "fine", "label": 1}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"text": "x", "label": 0}) + "\n{not json\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:3: malformed JSON"):
        train_classifier(TrainClassifierConfig(data=[str(path)], output=str(tmp_path / "m")))
    write_jsonl(path, [good, {"text": "x", "label": "good"}])
    with pytest.raises(InputError, match=r"bad\.jsonl:2: 'label' must be 1 or 0"):
        train_classifier(TrainClassifierConfig(data=[str(path)], output=str(tmp_path / "m")))
    write_jsonl(path, [good, {"body": "x", "label": 0}])
    with pytest.raises(InputError, match=r"bad\.jsonl:2: 'text' must be a string"):
        train_classifier(TrainClassifierConfig(data=[str(path)], output=str(tmp_path / "m")))
    write_jsonl(path, [good, good])
    with pytest.raises(InputError, match="both labels"):
        train_classifier(TrainClassifierConfig(data=[str(path)], output=str(tmp_path / "m")))
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("bad", [dict(threshold=0.5, percentile=50), dict(percentile=100), dict(threshold=1.5)])
def test_classifier_config_rejects_bad_cuts(bad):
    with pytest.raises(ValueError, match="classifier"):
        ClassifierConfig(model="m", **bad)


def test_steps_need_their_model():
    with pytest.raises(ValueError, match="train-classifier"):
        ClassifierScore(ClassifierConfig())
    with pytest.raises(ValueError, match="checkpoint"):
        PerplexityScore(PerplexityConfig())
    with pytest.raises(ValueError, match="hash_bits"):
        TrainClassifierConfig(hash_bits=40)


# --------------------------------------------------------------------------- perplexity


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory, small_tokenizer, small_tokenizer_dir, corpus_texts):
    """A tiny lmforge model trained for a few seconds on the first 50 corpus documents (its domain)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine is shared; one thread avoids spinning against other processes
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=small_tokenizer.vocab_size, d_model=64, n_layers=2, n_heads=4, ffn_hidden=192,
                      max_seq_len=256)
    model = Transformer(cfg)
    stream = torch.tensor([t for text in corpus_texts[:50] for t in [small_tokenizer.bos_id, *small_tokenizer.encode(text)]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(100):
            starts = torch.randint(0, len(stream) - 129, (16,), generator=gen)
            batch = torch.stack([stream[s : s + 129] for s in starts])
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("lm") / "ckpt"
    path.mkdir()
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


def test_perplexity_ranks_in_domain_text_below_shuffled_and_garbled(lm_checkpoint, corpus_texts, tmp_path):
    """In-domain: passages of the model's training documents; the same passages with their words
    shuffled, or their characters shuffled, must score worse. Unseen Shakespeare beats garbled text."""
    rng = np.random.default_rng(0)
    in_domain = [" ".join(t.split()[:150]) for t in corpus_texts[10:50:5]]
    shuffled = [" ".join(rng.permutation(t.split())) for t in in_domain]
    garbled = ["".join(rng.permutation(list(t))) for t in in_domain]
    unseen = [" ".join(t.split()[:150]) for t in corpus_texts[52:60]]
    docs = [Document(f"{k}{i}", t) for k, texts in (("in", in_domain), ("shuf", shuffled), ("garb", garbled))
            for i, t in enumerate(texts)]
    docs += [Document(f"unseen{i}", t) for i, t in enumerate(unseen)]
    for unit in ("perplexity", "bits_per_byte"):
        step = PerplexityScore(PerplexityConfig(checkpoint=str(lm_checkpoint), unit=unit, percentile=50))
        decisions = run_cut(step, [docs[:10], docs[10:]], tmp_path / unit)
        s = {d.id: d.metadata["perplexity_score"] for d in docs}
        for i in range(len(in_domain)):
            assert s[f"in{i}"] < s[f"shuf{i}"] < s[f"garb{i}"], (unit, i)
            assert s[f"unseen{i}"] < min(s[f"garb{j}"] for j in range(len(garbled))), (unit, i)
        # the median cut keeps the lower half: all in-domain text survives, garbled text does not
        kept = {d.id for d, dec in zip(docs, decisions) if dec is None}
        assert {f"in{i}" for i in range(len(in_domain))} <= kept and not any(k.startswith("garb") for k in kept)


def test_document_nll_matches_an_unbatched_forward_pass(lm_checkpoint, small_tokenizer, corpus_texts):
    from lmforge.checkpoints.load import load_model

    model, _ = load_model(lm_checkpoint)
    model.eval()
    token_bytes = torch.tensor(token_byte_lengths(small_tokenizer), dtype=torch.float64)
    texts = [corpus_texts[55][:600], corpus_texts[56][:150], "", "word"]
    nll, n_tok, n_bytes = document_nll(model, small_tokenizer, texts, max_tokens=80, batch_tokens=100,
                                       token_bytes=token_bytes)
    for i, text in enumerate(texts):
        ids = small_tokenizer.encode(text)[:80]
        assert n_tok[i] == len(ids)
        if not ids:
            assert nll[i] == 0
            continue
        seq = torch.tensor([[small_tokenizer.bos_id, *ids]])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[:, :-1]).float(), dim=-1)
        expected = -logp[0, torch.arange(len(ids)), seq[0, 1:]].sum().item()
        assert nll[i] == pytest.approx(expected, rel=1e-4)
        assert n_bytes[i] == len(small_tokenizer.decode(ids).encode("utf-8"))
    # the same scores whatever the batching
    nll_one, _, _ = document_nll(model, small_tokenizer, texts, max_tokens=80, batch_tokens=10_000,
                                 token_bytes=token_bytes)
    assert np.allclose(nll, nll_one, rtol=1e-4)


def test_empty_document_has_no_perplexity_and_is_rejected(lm_checkpoint, tmp_path):
    step = PerplexityScore(PerplexityConfig(checkpoint=str(lm_checkpoint), threshold=1e9))
    docs = [Document("empty", ""), Document("text", "To be, or not to be")]
    decisions = run_cut(step, [docs], tmp_path)
    assert decisions == ["perplexity_score undefined (no tokens to score)", None]
    assert "perplexity_score" not in docs[0].metadata
    assert math.isfinite(docs[1].metadata["perplexity_score"])
