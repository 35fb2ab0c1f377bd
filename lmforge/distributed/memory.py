"""Per-device memory of a training layout: parameters, gradients, optimizer state, activations.

The arithmetic follows what this code keeps alive, for the busiest pipeline stage:

- parameters: fp32 master weights (split by ``tp``, and by ``dp_shard`` under FSDP) plus the
  copies blocks compute with: FSDP's gathered weights in the compute dtype (every block's
  with ``reshard_after_forward: false``, two blocks' and the root's with ZeRO-3), or, with
  no FSDP, autocast's bf16 casts of the matrices (alive from forward to backward);
- gradients: fp32, split like the master weights (plus one block's unsharded gradients under FSDP);
- optimizer state: AdamW's and LAMB's two fp32 moments per parameter; Muon's one fp32 momentum
  per weight of the blocks' matrices and AdamW's two for the rest; split like the master weights;
- activations: what autograd saves per layer (Korthikanti et al. 2022 counted the same for
  GPT; here for pre-norm SwiGLU/GQA blocks with SDPA, whose attention scores are never
  stored), per token, times the tokens in flight; the output's log-softmax and its gradient
  in fp32 on the last stage. With activation checkpointing a layer keeps only its input, and
  one layer is recomputed at a time (after the output's gradients are gone). Tensor parallelism splits the heads', MLP and vocabulary
  terms (and, with sequence parallelism, the rest); pipeline stages hold their layers'
  activations for the micro-batches in flight (all of them for GPipe, up to ``pp`` for 1F1B).

``check_memory_fits`` refuses a training run whose plan cannot fit the device before the
stage allocates anything (a micro-batch of 10^8 rows would otherwise swap or hang).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lmforge.core.config import ConfigError
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import Layout, stage_layer_ranges


@dataclass
class MemoryPlan:
    """Bytes per device (the busiest pipeline stage); ``weights_compute`` is part of ``parameters``."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    weights_compute: int  # the weights in the compute dtype that blocks multiply with
    stage: int  # which pipeline stage this is
    params_on_device: int  # parameter count held by the device (unsharded by dp, split by tp)
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


def activation_bytes_per_token(model, tp: int, sequence_parallel: bool, compute_bytes: int, residual_bytes: int,
                               checkpointed: bool) -> float:
    """Bytes autograd keeps per token for one block between its forward and its backward."""
    d, h, kv, hd = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim
    seq = tp if sequence_parallel else 1
    if checkpointed:
        return residual_bytes * d / seq  # only the block's input
    c, r = compute_bytes, residual_bytes
    casts = 3 if c != r else 1  # autocast casts a norm's output once for each projection that reads it
    mlp_casts = (2 if model.ffn == "swiglu" else 1) if c != r else 1
    norms = (2 * r * d + casts * c * d + mlp_casts * c * d) / seq + 8  # inputs, outputs, two rstd
    attention = c * (h * hd + 2 * kv * hd) + 2 * c * h * hd + 4 * h  # q, k, v; output, its reshape; logsumexp
    mlp = model.ffn_activation_bytes(c)  # a block's FFN: w1 x, silu, w3 x, product (a mixture's: per expert it uses)
    return norms + (attention + mlp) / tp


def plan_memory(model, parallel: ParallelConfig, layout: Layout, *, micro_batch_size: int, seq_len: int,
                precision: str, activation_checkpointing: bool, optimizer: str = "adamw") -> MemoryPlan:
    """Per-device bytes of ``model`` (a ModelConfig) trained with ``layout`` and ``optimizer``
    (``train.optimizer``); the largest stage's."""
    tp, pp, shard = layout.tp, layout.pp, layout.dp_shard
    fsdp = layout.dp > 1
    c = 2 if precision == "bf16" else 4
    mixed = parallel.mixed_precision if parallel.mixed_precision != "auto" else ("bf16" if c == 2 else "fp32")
    gathered = 2 if (fsdp and mixed == "bf16") else 4  # bytes of the weights blocks compute with
    residual = 2 if (fsdp and mixed == "bf16") else 4  # the residual stream follows the embedding's dtype
    counts = model.param_counts()  # the model family's one count (ModelConfig.param_counts)
    embedding = counts.embedding + counts.positions
    V, d = model.vocab_size, model.d_model
    m = (parallel.pp_microbatches or pp) if pp > 1 else 1
    rows = micro_batch_size // m  # rows of one pipeline micro-batch
    loss_parallel = tp > 1 and parallel.loss_parallel and pp == 1

    best = None
    for stage, layers in enumerate(stage_layer_ranges(model.n_layers, pp)):
        first, last = stage == 0, stage == pp - 1
        if last:  # the multi-token prediction modules' blocks (model.mtp) follow the last layer
            layers = [*layers, *range(model.n_layers, len(counts.layers))]
        n_layers = len(layers)
        mats = sum(counts.layers[i].matrices for i in layers)
        norms = sum(counts.layers[i].norms for i in layers)
        block = max((counts.layers[i].matrices // tp + counts.layers[i].norms for i in layers), default=0)
        sharded_mats = mats // tp + (embedding // tp if first else 0)
        sharded_mats += counts.head_matmul // tp if last and not (model.tie_embeddings and first) else 0
        params = sharded_mats + norms + (counts.final_norm if last else 0)
        root = params - sum(counts.layers[i].matrices // tp + counts.layers[i].norms for i in layers)
        master = 4 * params // (shard if fsdp else 1)
        if fsdp:
            resident = params if not parallel.reshard_after_forward else root + min(2, n_layers) * block
            compute_copies = gathered * resident
            weights_compute = compute_copies
        else:  # autocast's bf16 casts of the matrices, kept for backward (one block's under checkpointing)
            kept = 1 if activation_checkpointing else n_layers
            kept_mats = mats if kept >= n_layers else max((counts.layers[i].matrices for i in layers), default=0)
            compute_copies = 2 * (kept_mats // tp + (counts.head_matmul // tp if last else 0)) if c == 2 else 0
            weights_compute = compute_copies if c == 2 else master
        parameters = master + compute_copies
        gradients = 4 * params // (shard if fsdp else 1) + (gathered * block if fsdp else 0)
        # Muon keeps one buffer for each weight of the blocks' matrices, AdamW two for everything else
        hidden = sum(counts.layers[i].matmul for i in layers) // tp if optimizer == "muon" else 0
        state = (8 * params - 4 * hidden) // (shard if fsdp else 1)

        in_flight = m if parallel.pp_schedule == "gpipe" or pp == 1 else min(m, pp - stage)
        tokens = rows * seq_len * in_flight
        saved = n_layers * tokens * activation_bytes_per_token(
            model, tp, parallel.sequence_parallel, c, residual, activation_checkpointing)
        saved += 8 * tokens if first else 0  # token ids
        # at the start of backward: the output's log-softmax, its gradient and the logits' gradient
        # (fp32, and again in the compute dtype under autocast); later, under checkpointing, one
        # block's recomputed activations: whichever is larger
        output = 0
        if last:
            vocab = V // tp if loss_parallel else V
            output = (residual + c) * d * tokens + (12 + (c if c != 4 else 0)) * vocab * rows * seq_len
        recomputed = activation_bytes_per_token(model, tp, parallel.sequence_parallel, c, residual, False) \
            * rows * seq_len if activation_checkpointing else 0
        acts = saved + max(output, recomputed)
        plan = MemoryPlan(parameters, gradients, state, int(acts), weights_compute, stage, params,
                          {"master_weights": master, "compute_copies": compute_copies, "layers": n_layers,
                           "tokens_in_flight": tokens})
        if best is None or plan.total > best.total:
            best = plan
    return best


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def peak_lower_bound(plan: MemoryPlan, adapters_only: bool = False) -> int:
    """Bytes a training step needs at least: weights and optimizer state, plus the larger of
    the gradients and the activations (backward frees activations as gradients appear). With
    adapters only (LoRA), just the activations: the frozen base may be stored in 4 bits."""
    if adapters_only:
        return plan.activations
    return plan.parameters + plan.optimizer + max(plan.gradients, plan.activations)


def available_bytes(device) -> tuple[int, str] | None:
    """(bytes a training process may use on ``device``, what they are), or None when unknown:
    a GPU's free memory (under ``torchrun`` the rank's own GPU), or the host's RAM shared by
    its local ranks."""
    if device.type == "cuda":
        import torch

        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"free on cuda:{index}"
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return total // ranks, "of RAM" + (f" per process ({ranks} on this host)" if ranks > 1 else "")
    return None


def check_memory_fits(model, parallel: ParallelConfig, layout: Layout, device, *, micro_batch_size: int,
                      seq_len: int, precision: str, activation_checkpointing: bool,
                      seq_key: str = "data.seq_len", adapters_only: bool = False, optimizer: str = "adamw") -> int | None:
    """Refuse (``ConfigError``, one line) a run whose step needs more than ``device`` has, by
    ``peak_lower_bound`` of its plan, before any allocation; the estimate in bytes, or None if
    the device's memory is unknown. ``precision: auto`` is planned at its cheaper choice."""
    have = available_bytes(device)
    if have is None:
        return None
    choices = ["bf16", "fp32"] if precision == "auto" else [precision]
    plans = [plan_memory(model, parallel, layout, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=p,
                         activation_checkpointing=activation_checkpointing, optimizer=optimizer) for p in choices]
    need = min(peak_lower_bound(p, adapters_only) for p in plans)
    available, what = have
    if need > available:
        plan = min(plans, key=lambda p: peak_lower_bound(p, adapters_only))
        held = "" if adapters_only else f"weights + optimizer {format_bytes(plan.parameters + plan.optimizer)}, "
        raise ConfigError(
            f"train.micro_batch_size = {micro_batch_size} x {seq_key} = {seq_len} needs at least "
            f"{format_bytes(need)} per device ({held}activations {format_bytes(plan.activations)}), more than the "
            f"{format_bytes(available)} {what}: lower train.micro_batch_size (train.batch_tokens keeps the tokens "
            f"per step) or {seq_key}, or set train.activation_checkpointing=true")
    return need
