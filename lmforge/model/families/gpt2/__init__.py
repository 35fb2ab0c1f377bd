"""The GPT-2 family (Radford et al. 2019; nanoGPT's model): token embeddings plus learned absolute
position embeddings, pre-norm blocks of LayerNorm (with biases), multi-head attention and a
tanh-GELU MLP four times as wide, biases on every linear, and the head tied to the token embedding.

The blocks are the shared ones (``model.transformer.Block``) and the learned positions the shared
``Transformer.pos_embed``, so ``GPT2`` adds no arithmetic of its own: what makes the family is
``GPT2Config``'s defaults, its presets and its Hugging Face mapping (``hf.py``, ``GPT2LMHeadModel``:
Conv1D weights and the joined q|k|v ``c_attn``). The shared parts' other options (GQA, QK-norm,
RMSNorm, SwiGLU, sliding windows, no biases, an untied head) train and decode here too; export
refuses those ``GPT2LMHeadModel`` cannot compute, and writes zeros for missing biases.
"""

from __future__ import annotations

from lmforge.model.families.gpt2 import hf
from lmforge.model.families.gpt2.config import GPT2Config
from lmforge.model.family import Family, HFMapping
from lmforge.model.transformer import Transformer


class GPT2(Transformer):
    """GPT-2: the shared blocks over token + learned position embeddings (``Transformer.embed_tokens``)."""

    config_class = GPT2Config


PRESETS: dict[str, dict] = {
    # GPT-2 small (openai-community/gpt2): 124.4M parameters, 1024 learned positions, GPT-2's BPE vocabulary.
    "gpt2-124m": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
}

FAMILY = Family(
    name="gpt2",
    summary="GPT-2 and nanoGPT: learned positions, LayerNorm, tanh-GELU MLP, biases, tied head",
    config=GPT2Config,
    model=GPT2,
    presets=PRESETS,
    hf=HFMapping.from_module(hf),
)
