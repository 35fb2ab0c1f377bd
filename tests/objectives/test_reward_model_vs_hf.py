"""``RewardModel`` against transformers' ``LlamaForSequenceClassification(num_labels=1)`` on the same weights.

Both read the score at each row's last real token, with right and left padding. transformers
finds that token by comparing ids with ``pad_token_id``; ours uses the attention mask, so
with pad == EOS ours still reads the trailing EOS, where transformers reads the token before.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.testing import assert_close

from lmforge.data.preference import pair_rows, parse_pair
from lmforge.model.config import ModelConfig
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.reward import RewardModel, last_token_index
from tests.model.test_hf import randomized

RECORDS = [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a city in the south of Spain."},
           {"prompt": "Q", "chosen": " yes", "rejected": " no"},
           {"prompt": "Once upon a time there", "chosen": " was a cat who sat.", "rejected": " were."}]


def sequence_classifier(model: RewardModel, pad_token_id: int) -> torch.nn.Module:
    """``LlamaForSequenceClassification`` holding ``model``'s backbone and its head's weight as ``score.weight``."""
    cfg = model.cfg
    config = transformers.AutoConfig.for_model(**hf_config_dict(cfg), num_labels=1, pad_token_id=pad_token_id)
    config._attn_implementation = "sdpa"  # eager turns fully masked (left-padding) rows into NaN
    hf = transformers.LlamaForSequenceClassification(config).double().eval()
    state = {k: v for k, v in state_dict_to_hf(model.backbone.state_dict(), cfg).items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict({**state, "score.weight": model.score.weight}, strict=False)
    assert not missing and not unexpected
    return hf


@pytest.mark.parametrize("pad", ["pad", "eos"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_reward_model_scores_equal_llama_for_sequence_classification(small_tokenizer, side, pad):
    tok = small_tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                      max_seq_len=64)
    model = RewardModel(randomized(cfg).double()).double().eval()
    with torch.no_grad():
        model.score.bias.fill_(0.25)  # transformers' head has no bias: added to its scores below
    pad_id = tok.eos_id if pad == "eos" else tok.pad_id
    rows = pair_rows([parse_pair(tok, r, 64, "error")[0] for r in RECORDS], pad_id, side=side)
    ids = torch.cat([rows["chosen_input_ids"], rows["rejected_input_ids"]])
    mask = torch.cat([rows["chosen_attention_mask"], rows["rejected_attention_mask"]])
    assert (mask == 0).any()  # the batch really is padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers counts positions from 0 unless told

    with torch.no_grad():
        ours = model(ids, mask)
        # transformers told the pads apart by an id no real token has, so it reads the same token as ours
        unused = tok.vocab_size - 1
        assert not (ids[mask.bool()] == unused).any()
        hf = sequence_classifier(model, unused)
        theirs = hf(input_ids=ids.masked_fill(mask == 0, unused), attention_mask=mask,
                    position_ids=positions).logits.squeeze(-1)
        assert_close(ours, theirs + 0.25, rtol=1e-5, atol=1e-6)

    if pad == "eos":  # told pad = EOS, transformers reads the token before each trailing EOS instead
        last = last_token_index(mask)
        assert (ids[torch.arange(len(ids)), last] == tok.eos_id).all()
        without_eos = mask.clone()
        without_eos[torch.arange(len(ids)), last] = 0
        with torch.no_grad():
            theirs = sequence_classifier(model, tok.eos_id)(input_ids=ids, attention_mask=mask,
                                                            position_ids=positions).logits.squeeze(-1)
            assert_close(model(ids, without_eos), theirs + 0.25, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(ours, theirs + 0.25)
