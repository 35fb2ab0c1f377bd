"""The reference implementations the RL math is checked against, loaded for the tests.

torchtune is installed without its dependencies (a test-only reference) and its package
``__init__`` needs torchao, so ``rlhf/rewards.py`` (torch only) is loaded from its file, and
``rlhf/loss/ppo.py`` with its one import (``from torchtune import rlhf``) pointed at that module.

TRL's GRPO loss lives inside ``GRPOTrainer._compute_loss(self, model, inputs)``; it is called here
unbound on a stub ``self`` that carries only the attributes the method reads, with the model's
forward (``_get_per_token_logps_and_entropies``) replaced by given log-probs, so the tests run
TRL's own code on chosen tensors, not a transcription of it.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch


def _torchtune_dir() -> Path:
    spec = importlib.util.find_spec("torchtune")
    assert spec is not None and spec.submodule_search_locations, "torchtune (test dependency) is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "rlhf"


def _load(name: str, path: Path, modules: dict[str, types.ModuleType] | None = None) -> types.ModuleType:
    saved = {k: sys.modules.get(k) for k in modules or {}}
    sys.modules.update(modules or {})
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def load_torchtune_rlhf() -> tuple[types.ModuleType, type]:
    """torchtune.rlhf's functions (estimate_advantages, whiten, get_rewards_ppo...) and its PPOLoss."""
    rlhf = _load("torchtune_rlhf_reference", _torchtune_dir() / "rewards.py")
    package = types.ModuleType("torchtune")
    package.rlhf = rlhf
    ppo = _load("torchtune_ppo_reference", _torchtune_dir() / "loss" / "ppo.py", {"torchtune": package})
    return rlhf, ppo.PPOLoss


def trl_grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                  loss_type: str, beta: float = 0.0, ref_logp: torch.Tensor | None = None, epsilon: float = 0.2,
                  epsilon_high: float | None = None, delta: float | None = None, importance_sampling_level: str = "token",
                  max_completion_length: int | None = None, num_items_in_batch: int | None = None,
                  importance_sampling_ratio: torch.Tensor | None = None):
    """TRL's ``GRPOTrainer._compute_loss`` on these log-probs: (loss, the metrics it logged). With
    ``importance_sampling_ratio`` (B, T), the vLLM correction weight TRL multiplies each token's loss by."""
    from trl import GRPOTrainer

    B, T = logp.shape
    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  reduce=lambda x, reduction="sum": x)
    args = SimpleNamespace(use_bias_correction_kl=False, delta=delta)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level, beta=beta, args=args, loss_type=loss_type,
        epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=importance_sampling_ratio is not None,
        vllm_importance_sampling_correction=importance_sampling_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length or T, accelerator=accelerator, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    stub.args.steps_per_generation = 1
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.to(torch.long),
        "advantages": advantages, "old_per_token_logps": old_logp,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items_in_batch is None else num_items_in_batch)),
    }
    if ref_logp is not None:
        inputs["ref_per_token_logps"] = ref_logp
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}
