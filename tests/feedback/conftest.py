"""Fixtures of the feedback tests: a tiny judge checkpoint that answers "A" or "B" (so its soft
labels come from log-probs), and a prompt file of demo tasks."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.sft_demo import make_examples
from lmforge.data.tokenizer import Tokenizer
from lmforge.feedback.judges import Comparison, comparison_messages
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from tests.conftest import write_jsonl


@pytest.fixture(scope="session")
def judge_checkpoint(tmp_path_factory, small_tokenizer_dir):
    """A random tiny model (context 1024, for the judge's long prompts) whose head is rescaled so
    that its answer to a comparison is "A" or "B": every row small, except that those of "A" and
    "B" meet the hidden state at the answer position (nearly the same for every prompt of a
    random model) with logit about 10, plus and minus a random part. Its P(A) is soft (about
    0.4 to 0.6) and moves a little with the prompt."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=1024, tie_embeddings=False)).eval()
    tok = Tokenizer.load(small_tokenizer_dir)
    prompt = chat_prompt_ids(tok, comparison_messages(Comparison("k", "q", "a", "b", "Which?")))
    seen = []
    with torch.no_grad():
        hook = model.norm.register_forward_hook(lambda module, inputs, out: seen.append(out[0, -1]))
        model(torch.tensor([prompt]))
        hook.remove()
        h, apart = seen[0], 0.5 * torch.randn(32)
        model.lm_head.weight.mul_(0.05)
        model.lm_head.weight[tok.token_to_id("A")] = 10 * h / h.norm() ** 2 + apart
        model.lm_head.weight[tok.token_to_id("B")] = 10 * h / h.norm() ** 2 - apart
    path = tmp_path_factory.mktemp("judge")
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


@pytest.fixture()
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", make_examples(6, seed=2))
