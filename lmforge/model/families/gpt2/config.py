"""``GPT2Config``: the GPT-2 family's config, ``ModelConfig`` with GPT-2's parts as its defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmforge.core.config import option
from lmforge.model.config import ModelConfig


@dataclass
class GPT2Config(ModelConfig):
    """``ModelConfig`` with GPT-2's parts as the defaults; positions are always learned."""

    family: str = option("gpt2", help="the model family (lmforge.model.families): its blocks, counts, HF mapping; "
                         "a preset sets it")
    ffn: Literal["swiglu", "gelu"] = option("gelu", help="gelu: GPT-2's tanh-GELU MLP; swiglu: Llama's gated one "
                                            "(GPT2LMHeadModel has no such MLP: export refuses it)")
    norm: Literal["rmsnorm", "layernorm"] = option("layernorm", help="layernorm with a bias (GPT-2), or rmsnorm "
                                                   "(GPT2LMHeadModel has no such norm: export refuses it)")
    positions: Literal["rope", "alibi", "learned"] = option(
        "learned", help="learned: a trained embedding per position added to the tokens' (GPT-2's wpe), max_seq_len "
        "of them; the only positions of the gpt2 family (RoPE or ALiBi models are the llama family's)")
    tie_embeddings: bool = option(True, help="the output head shares the token embedding's weights (GPT-2 ties them)")
    qkv_bias: bool = option(True, help="biases on the query/key/value projections (GPT-2's c_attn has them)")
    out_bias: bool = option(True, help="bias on the attention output projection (GPT-2's attn.c_proj)")
    mlp_bias: bool = option(True, help="biases on the MLP's linears (GPT-2's c_fc and mlp.c_proj)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions != "learned":
            raise ValueError(f"positions {self.positions!r}: the gpt2 family has learned absolute positions; a "
                             "RoPE or ALiBi model with GPT-2's other parts is family llama with positions, norm, ffn "
                             "and the biases set")
