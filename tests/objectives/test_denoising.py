import pytest
import torch

from lmforge.data.packing import IGNORE_INDEX
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.denoising import (
    DENOISING_LOSSES,
    DenoisingObjective,
    masked_lm_loss,
    prefix_lm_mask,
    span_corruption_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                   max_seq_len=32)).eval()


def test_the_prefix_mask_is_bidirectional_over_the_prefix_and_causal_after_it():
    mask = prefix_lm_mask(torch.tensor([3, 1, 5]), 5)
    assert mask.shape == (3, 1, 5, 5) and mask.dtype == torch.bool
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(mask[1, 0], causal) and torch.equal(mask[2, 0], torch.ones(5, 5, dtype=torch.bool))
    expected = causal.clone()
    expected[:3, :3] = True  # the prefix sees itself whole; later queries see it and themselves
    assert torch.equal(mask[0, 0], expected)


def test_a_prefix_of_one_token_is_the_models_causal_forward():
    model, tokens = tiny_model(), torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(tokens, attn_mask=prefix_lm_mask(torch.tensor([1, 1]), 12)), model(tokens), atol=1e-6)


def test_a_masked_lm_row_attends_both_ways_and_a_prefix_never_sees_what_follows_it():
    model, tokens = tiny_model(), torch.randint(0, 64, (1, 12))
    changed = tokens.clone()
    changed[0, 9] = (tokens[0, 9] + 1) % 64
    with torch.no_grad():
        def logits(x, prefix):
            return model(x, attn_mask=prefix_lm_mask(torch.tensor([prefix]), 12))
        assert not torch.allclose(logits(tokens, 12)[0, 2], logits(changed, 12)[0, 2])  # bidirectional: 2 sees 9
        assert torch.equal(logits(tokens, 6)[0, :9], logits(changed, 6)[0, :9])  # prefix 6: nothing before 9 sees it
        assert not torch.allclose(logits(tokens, 10)[0, 2], logits(changed, 10)[0, 2])  # 9 inside the prefix


def test_the_losses_are_the_summed_log_likelihood_of_the_labelled_positions():
    torch.manual_seed(1)
    logits, labels = torch.randn(2, 5, 11), torch.full((2, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 3], labels[1, 4] = 4, 7, 0
    log_p = logits.log_softmax(-1)
    expected = -(log_p[0, 1, 4] + log_p[1, 3, 7] + log_p[1, 4, 0])
    for loss in DENOISING_LOSSES.values():
        assert torch.allclose(loss(logits, labels), expected, atol=1e-6)
    assert masked_lm_loss(logits.bfloat16(), labels).dtype == torch.float32  # computed in float32
    assert span_corruption_loss(logits, torch.full((2, 5), IGNORE_INDEX)) == 0


def test_the_objective_counts_its_targets_and_logs_masked_token_accuracy():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 10))
    labels = torch.full((2, 10), IGNORE_INDEX)
    labels[0, 3], labels[1, 0], labels[1, 7] = 5, 6, 7
    batch = {"input_ids": tokens, "labels": labels, "prefix_len": torch.tensor([10, 10])}
    objective = DenoisingObjective("mlm", token_bytes=torch.arange(64))
    with torch.no_grad():
        out = objective(model, batch)
        logits = model(tokens, attn_mask=prefix_lm_mask(batch["prefix_len"], 10))
    assert out.n_targets == objective.num_targets(batch) == 3 and objective.num_tokens(batch) == 20
    assert torch.allclose(out.loss_sum, masked_lm_loss(logits, labels))
    scored = labels != IGNORE_INDEX
    assert out.metrics["accuracy"] == (logits.argmax(-1)[scored] == labels[scored]).sum()
    assert out.n_bytes == 5 + 6 + 7  # the targets' bytes, for bits per byte in evaluation
    with pytest.raises(ValueError, match="unknown denoising objective"):
        DenoisingObjective("clm")
