"""A reward model: the transformer plus a scalar head read at the last real token.

As transformers' ``*ForSequenceClassification(num_labels=1)`` and TRL's RewardTrainer: the
score of a sequence is ``w·h_last + b`` where ``h_last`` is the final hidden state of its
last non-pad token. The head starts at N(0, 1/√(d+1)) with zero bias (Stiennon et al.
2020, "N implementation details of RLHF"). Saved as the backbone's checkpoint files plus
``reward_head.safetensors``, so the backbone still loads as a language model.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.core.io import InputError
from lmforge.model.transformer import Transformer, positions_and_mask

HEAD_FILE = "reward_head.safetensors"


def last_token_index(tokens: torch.Tensor, pad_id: int | None = None) -> torch.Tensor:
    """Index of the last real token of each row, where a reward model reads its score.

    ``tokens`` is either an attention mask (``pad_id=None``: non-zero = real) or input ids
    compared with ``pad_id``. Works with left and right padding. When pad == eos, pass the
    attention mask: ids alone cannot tell a trailing EOS from padding, and then this
    returns the token before it, as transformers' sequence-classification pooling does.
    """
    real = tokens != 0 if pad_id is None else tokens != pad_id
    if tokens.ndim != 2:
        raise ValueError(f"expected (B, T) attention mask or ids, got shape {tuple(tokens.shape)}")
    empty = ~real.any(-1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have no real token; drop empty sequences before scoring")
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return (positions * real).argmax(-1)


def is_left_padded(attention_mask: torch.Tensor) -> bool:
    return bool((attention_mask[:, 0] == 0).any())


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """Keyword arguments for ``Transformer.forward``: none for right padding (causal attention
    never looks ahead at trailing pads), positions and a mask for left padding."""
    if attention_mask is None or not is_left_padded(attention_mask):
        return {}
    positions, mask = positions_and_mask(attention_mask)
    return {"positions": positions, "attn_mask": mask}


class RewardModel(nn.Module):
    def __init__(self, backbone: Transformer):
        super().__init__()
        self.backbone = backbone
        d = backbone.cfg.d_model
        self.score = nn.Linear(d, 1, device=backbone.embed.weight.device, dtype=backbone.embed.weight.dtype)
        nn.init.normal_(self.score.weight, std=1 / math.sqrt(d + 1))
        nn.init.zeros_(self.score.bias)

    @property
    def cfg(self):
        return self.backbone.cfg

    @property
    def layers(self) -> nn.ModuleList:
        """The backbone's blocks, where ``distributed.parallelize`` finds them (the head joins the root's FSDP group)."""
        return self.backbone.layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Rewards (B,) at each row's last real token (the last column when there is no mask)."""
        hidden = self.backbone.hidden_states(input_ids, **model_inputs(input_ids, attention_mask))
        if attention_mask is None:
            last = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
        else:
            last = last_token_index(attention_mask)
        h = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        rewards = self.score(h).squeeze(-1)
        return rewards.float() if rewards.dtype in (torch.float16, torch.bfloat16) else rewards

    def save_head(self, directory: str | Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self.score.state_dict().items()},
                  str(Path(directory) / HEAD_FILE), metadata={"format": "pt"})


def with_reward_head(backbone: Transformer, directory: str | Path, device: str | torch.device = "cpu") -> RewardModel:
    """``backbone`` (loaded from the checkpoint ``directory``) with the reward head saved beside it
    by ``lmforge reward``; ``lmforge.checkpoints.load.load_reward_model`` loads both from a path."""
    head = Path(directory) / HEAD_FILE
    if not head.is_file():
        raise InputError(f"{directory}: no {HEAD_FILE}; this checkpoint is a language model, not a reward model")
    model = RewardModel(backbone)
    try:
        state = load_file(str(head), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise InputError(f"{head}: cannot read the reward head: {exc}") from exc
    model.score.load_state_dict(state)
    return model
