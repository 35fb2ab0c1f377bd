"""The frozen reference model of DPO and KTO, and its log-probabilities.

The reference scores completions under ``torch.no_grad`` in eval mode, inside the same
autocast as the policy, so it computes in the policy's dtype: with policy == reference the
DPO loss is exactly ln 2 (a reference in another dtype breaks this, as reported for the DPO
reference implementation). With LoRA the reference is the policy with its adapters
disabled, so no second copy of the model is held; with full fine-tuning it is a frozen copy.
Its log-probabilities can instead be precomputed in one pass over the data before training
(TRL's ``precompute_ref_log_probs``): the policy then scores them itself, as it still equals
the reference, and no copy is made at all.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from lmforge.model.reward import is_left_padded, model_inputs
from lmforge.objectives.preference import sequence_logprobs
from lmforge.peft.lora import disable_adapters, lora_modules

# reference(input_ids, labels, attention_mask) -> summed completion log-probs (B,)
Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def completion_logprobs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed completion log-probs (B,), completion token counts (B,), logits) of ``model``."""
    logits = model(input_ids, **model_inputs(input_ids, attention_mask))
    logps, n_tokens = sequence_logprobs(logits, labels)
    return logps, n_tokens, logits


def _scored_in_eval_mode(model: nn.Module, input_ids, labels, attention_mask) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return completion_logprobs(model, input_ids, labels, attention_mask)[0]
    finally:
        model.train(was_training)


def adapters_disabled_reference(model: nn.Module) -> Reference:
    """The reference of a LoRA policy: the same model with its adapters switched off."""
    if not lora_modules(model):
        raise ValueError("adapters_disabled_reference: the model has no LoRA layers")

    def reference(input_ids, labels, attention_mask=None):
        with disable_adapters(model):
            return _scored_in_eval_mode(model, input_ids, labels, attention_mask)

    return reference


def frozen_copy_reference(model: nn.Module, prepare: Callable[[nn.Module], None] | None = None) -> Reference:
    """The reference of a fully fine-tuned policy: a frozen copy of it taken now, in eval mode.
    ``prepare(copy)`` changes the copy in place before use (a distributed run shards it as the policy)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    if prepare is not None:
        prepare(ref)

    def reference(input_ids, labels, attention_mask=None):
        return _scored_in_eval_mode(ref, input_ids, labels, attention_mask)

    return reference


def policy_reference(model: nn.Module, prepare: Callable[[nn.Module], None] | None = None) -> Reference:
    """The reference for a policy as it is now: adapters disabled with LoRA, else a frozen copy
    (``prepare`` as in ``frozen_copy_reference``)."""
    return adapters_disabled_reference(model) if lora_modules(model) else frozen_copy_reference(model, prepare)


def untrained_policy_reference(model: nn.Module) -> Reference:
    """The policy itself as the reference (adapters disabled with LoRA), with no copy of the weights.

    Only valid while the policy has not been updated, so only for precomputing the
    reference's log-probs before training; a live reference needs ``policy_reference``.
    """
    if lora_modules(model):
        return adapters_disabled_reference(model)

    def reference(input_ids, labels, attention_mask=None):
        return _scored_in_eval_mode(model, input_ids, labels, attention_mask)

    return reference


def precompute_logprobs(reference: Reference, rows: dict[str, torch.Tensor], prefix: str, batch_size: int,
                        device: torch.device, autocast: Callable[[], object]) -> torch.Tensor:
    """Summed completion log-probs of every ``{prefix}input_ids`` row, in batches, on ``device``'s CPU copy."""
    ids, labels = rows[f"{prefix}input_ids"], rows[f"{prefix}labels"]
    mask = rows.get(f"{prefix}attention_mask")
    out = []
    for start in range(0, len(ids), batch_size):
        cols = slice(start, start + batch_size)
        batch_mask = mask[cols] if mask is not None else None
        b_ids, b_labels, b_mask = trim_padding(ids[cols], labels[cols], batch_mask)
        with autocast():
            logps = reference(b_ids.to(device), b_labels.to(device), b_mask.to(device) if b_mask is not None else None)
        out.append(logps.float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def trim_padding(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                 multiple_of: int = 8, static: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop columns that are padding in every row (trailing for right padding, leading for left),
    keeping the length a multiple of ``multiple_of`` so few distinct shapes occur; with ``static``
    (a compiled objective, ``Objective.static_shapes``) keep every column, one shape for every batch."""
    if attention_mask is None or static:
        return input_ids, labels, attention_mask
    T = input_ids.shape[1]
    n = int(attention_mask.sum(-1).max())
    keep = min(T, math.ceil(n / multiple_of) * multiple_of)
    if keep == T:
        return input_ids, labels, attention_mask
    cols = slice(T - keep, T) if is_left_padded(attention_mask) else slice(0, keep)
    return input_ids[:, cols], labels[:, cols], attention_mask[:, cols]
