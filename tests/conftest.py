"""Shared fixtures: a small real corpus and a tokenizer trained on it once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "data" / "pretrain" / "shakespeare.jsonl"

# Tests never time a dtype's matmul peak (emulated fp16 takes minutes on some CPUs): MFU divides
# by these fixed figures in this process and in every subprocess it starts (torchrun included).
os.environ["LMFORGE_PEAK_FLOPS"] = "float32=2e11,bfloat16=8e11,float16=8e11"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """About 60 short documents of real English prose from the bundled demo corpus."""
    texts = []
    with open(SHAKESPEARE, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            # cut long works into paragraph groups so there are many short documents
            paragraphs = [p for p in text.split("\n\n") if p.strip()]
            for i in range(0, min(len(paragraphs), 120), 12):
                texts.append("\n\n".join(paragraphs[i : i + 12]))
            if len(texts) >= 60:
                break
    return texts[:60]


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory, corpus_texts) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=512)).save(path)
    return path


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(small_tokenizer_dir)


@pytest.fixture()
def corpus_jsonl(tmp_path, corpus_texts) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"doc{i}", "text": t} for i, t in enumerate(corpus_texts)])
