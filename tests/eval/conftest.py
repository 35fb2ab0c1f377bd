"""Fixtures of the eval tests: a tiny checkpoint (random weights, the shared tokenizer) and
local JSONL tasks of every output type, in lm-evaluation-harness's YAML format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, small_tokenizer_dir) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("eval-ckpt"), small_tokenizer_dir)


def write_tiny_checkpoint(path: Path, tokenizer_dir: Path) -> Path:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=64))
    with torch.no_grad():  # larger weights than the init's, so log-likelihoods and greedy tokens differ by input
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    write_model_files(path, model, tokenizer_dir)
    write_checksums(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


WORDS = ["apple", "river", "stone", "cloud", "tiger", "lamp", "garden", "violin", "copper", "maple"]

MC_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: mc_train.jsonl
    test: mc_test.jsonl
test_split: test
fewshot_split: train
output_type: multiple_choice
doc_to_text: "Question: which word is {{ word }}?\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
num_fewshot: 2
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  - metric: acc_bytes
    aggregation: mean
    higher_is_better: true
"""

LL_YAML = """\
task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files: ll.jsonl
test_split: train
fewshot_split: train
num_fewshot: 2
output_type: loglikelihood
doc_to_text: "{{ prefix }}"
doc_to_target: " {{ answer }}"
"""

ROLLING_YAML = """\
task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: rolling.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
"""

GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{ q }}\\nA:"
doc_to_target: "{{ a }}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
filter_list:
  - name: raw
    filter:
      - function: take_first
  - name: first-word
    filter:
      - function: regex
        regex_pattern: "([a-z]+)"
        group_select: 0
      - function: take_first
"""


GEN_PROMPT = "Q: name the {}\nA:"
GEN_KWARGS = {"until": ["\n", "."], "max_gen_toks": 6, "do_sample": False}


def model_answers(model, tok) -> list[str]:
    """The generation task's targets: the model's own greedy answer for even documents, a wrong one for odd."""
    from lmforge.eval.scoring import generate_until

    outputs = generate_until(model, tok, [(GEN_PROMPT.format(w), GEN_KWARGS) for w in WORDS])
    return [out if i % 2 == 0 else "zzz" for i, out in enumerate(outputs)]


def write_tasks(root: Path, corpus_texts: list[str], model_answers: list[str] | None = None) -> dict[str, Path]:
    """The four task files and their data under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    mc = [{"word": w, "choices": [w, WORDS[(i + 3) % 10] + "s", "a " + WORDS[(i + 5) % 10]], "label": i % 3}
          for i, w in enumerate(WORDS)]
    write_jsonl(root / "mc_train.jsonl", mc[:6])
    write_jsonl(root / "mc_test.jsonl", mc[4:])
    write_jsonl(root / "ll.jsonl", [{"prefix": f"The {w} is", "answer": WORDS[(i + 1) % 10]} for i, w in enumerate(WORDS)])
    write_jsonl(root / "rolling.jsonl", [{"text": t[: 200 + 150 * i]} for i, t in enumerate(corpus_texts[:4])])
    answers = model_answers or [w.upper() for w in WORDS]
    write_jsonl(root / "gen.jsonl", [{"q": f"name the {w}", "a": a} for w, a in zip(WORDS, answers)])
    files = {"tiny_mc": MC_YAML, "tiny_ll": LL_YAML, "tiny_rolling": ROLLING_YAML, "tiny_gen": GEN_YAML}
    out = {}
    for name, text in files.items():
        out[name] = root / f"{name}.yaml"
        out[name].write_text(text, encoding="utf-8")
    return out
