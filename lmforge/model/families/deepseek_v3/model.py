"""DeepSeek-V3's model, built from the shared parts: pre-norm blocks of multi-head latent attention
(``model.mla.MLA``) and the shared SwiGLU MLP (the first ``moe.first_dense_layers``) or the routed FFN
(``model.moe.MoE``), the shared embedding, final norm and head.

RoPE rotates the decoupled part of q and k in interleaved pairs where ``rope_interleave`` is set
(``mla.rotate_interleaved``), as DeepSeek's weights expect, so
the weights map to transformers' ``DeepseekV3ForCausalLM`` one to one. Cached decoding keeps the
latent and the RoPE key per token (``model.mla.latent_cache``)."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.core.config import ConfigError
from lmforge.model.families.deepseek_v3.config import DeepseekV3Config
from lmforge.model.kv_cache import KVCache
from lmforge.model.mla import MLA, latent_cache
from lmforge.model.moe import MoE
from lmforge.model.transformer import MLP, Block, Transformer, make_norm


class DeepseekV3Block(nn.Module):
    """Pre-norm: x + mla(norm(x)), then x + ffn(norm(x)) (the shared ``Block``'s forward), ffn the routed
    experts on a sparse layer, else the dense MLP; each branch's output dropped out in training."""

    def __init__(self, cfg: DeepseekV3Config, layer: int):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = MLA(cfg, layer)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        sparse = cfg.sparse_layers()[min(layer, cfg.n_layers - 1)]  # an MTP module's block: the last layer's kind
        self.mlp = MoE(cfg.d_model, cfg.moe, layer, cfg.ffn_hidden) if sparse else MLP(cfg)
        self.resid_dropout = cfg.resid_dropout

    forward = Block.forward


class DeepseekV3(Transformer):
    """The shared embedding, final norm and head around DeepSeek-V3's blocks."""

    config_class = DeepseekV3Config
    block_class = DeepseekV3Block

    def new_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                     kv_dtype: str = "auto", layers: range | None = None) -> KVCache:
        """The engine's cache of this model: each token's latent and RoPE key (``mla.latent_cache``), stored as
        ``kv_dtype``, for ``batch`` rows of up to ``max_len`` positions, of ``layers`` (default every layer)."""
        return latent_cache(self.cfg, batch, max_len, dtype, device, kv_dtype, layers)

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        """Heads split across ranks: the query's (or its expanding) projection and the latent's up-projection
        column-wise, whole heads each (their rows are head-major), the output projection row-wise; the
        compressing projections and their norms replicated (every rank needs the whole latent); the MLP as
        the shared plan splits it. A model with routed layers is refused: its experts are stacked tensors no column or
        row split of ``nn.Linear`` reaches."""
        if any(self.cfg.sparse_layers()):
            raise ConfigError("tensor parallelism does not support model family 'deepseek_v3' with routed layers: their "
                              "experts are stacked (E, f, d) tensors that a column/row split of nn.Linear layers does not "
                              "reach, and expert parallelism is not built; set parallel.tp = 1 (FSDP applies), or "
                              "model.moe.first_dense_layers to n_layers for a dense model")
        query = "attn.wq" if block.attn.wq is not None else "attn.wq_b"
        return {query: "colwise", "attn.wkv_b": "colwise", "attn.wo": "rowwise", "mlp.w1": "colwise",
                "mlp.w3": "colwise", "mlp.w2": "rowwise", "attn_norm": "norm", "mlp_norm": "norm", "attn": "attention",
                "mlp": "mlp"}
