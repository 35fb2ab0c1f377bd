"""The mixture-of-experts family's blocks: the shared pre-norm block with ``model.moe.MoE`` in the
MLP's place on its sparse layers."""

from __future__ import annotations

from torch import nn

from lmforge.core.config import ConfigError
from lmforge.model.families.mixtral.config import MixtralConfig
from lmforge.model.moe import MoE
from lmforge.model.transformer import Block, Transformer


class MoEBlock(Block):
    """x + attn(norm(x)), then x + ffn(norm(x)), ffn the routed experts on a sparse layer, else the dense MLP."""

    def __init__(self, cfg: MixtralConfig, layer: int):
        super().__init__(cfg, layer)
        if cfg.sparse_layers()[min(layer, cfg.n_layers - 1)]:  # an MTP module's block: the last layer's kind
            self.mlp = MoE(cfg.d_model, cfg.moe, layer, cfg.ffn_hidden)


class Mixtral(Transformer):
    """The shared embedding, final norm and head around ``MoEBlock``s."""

    config_class = MixtralConfig
    block_class = MoEBlock

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        raise ConfigError("tensor parallelism does not support model family 'mixtral': its experts are stacked "
                          "(E, f, d) tensors that a column/row split of nn.Linear layers does not reach, and expert "
                          "parallelism is not built; set parallel.tp = 1 (FSDP applies)")
