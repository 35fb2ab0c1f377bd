"""The ``parallel:`` section of a training recipe: how one run is laid out over devices.

The degrees multiply to the world size (``torchrun --nproc_per_node``, or Slurm tasks):
``dp_replicate x dp_shard x tp x pp``. The default (``dp_shard: -1``, everything else 1)
is plain FSDP over every process, which in a single process is no parallelism at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from lmforge.core.config import at_least, option, positive


@dataclass
class ParallelConfig:
    """Data (FSDP2 / HSDP), tensor and pipeline parallel degrees and their options."""

    dp_replicate: int = positive(
        1, help="data-parallel replicas that each hold whole weights (HSDP when dp_shard > 1 too)"
    )
    dp_shard: int = at_least(
        1, -1, also=(-1,), help="FSDP2 sharding degree; -1 = what the world size leaves after the other degrees"
    )
    tp: int = positive(
        1, help="tensor parallel: attention heads, MLP width and vocabulary split over this many devices"
    )
    pp: int = positive(1, help="pipeline parallel: consecutive layers split into this many stages")
    pp_schedule: Literal["gpipe", "1f1b"] = option("1f1b", help="GPipe (all forwards, then all backwards) or 1F1B")
    pp_microbatches: int | None = positive(
        None, help="pipeline micro-batches per train.micro_batch_size rows; None = pp"
    )
    reshard_after_forward: bool = option(
        True, help="FSDP: True = ZeRO-3 (free gathered weights after forward); False = ZeRO-2-like"
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", help="FSDP weights in this dtype, grads reduced in fp32; auto = train.precision"
    )
    sequence_parallel: bool = option(
        False, help="tp: norms and residuals sharded along the sequence (less activation memory)"
    )
    loss_parallel: bool = option(True, help="tp: vocabulary-parallel output and cross-entropy, logits never gathered")
    async_checkpoint: bool = option(False, help="write sharded checkpoints in the background while training continues")
    backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", help="process-group backend; auto = nccl on GPUs, gloo on CPUs"
    )

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be at least 1, got {getattr(self, name)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"parallel.dp_shard must be at least 1, or -1 for the rest of the world, got {self.dp_shard}")
        if self.pp_microbatches is not None and self.pp_microbatches < 1:
            raise ValueError(f"parallel.pp_microbatches must be at least 1, got {self.pp_microbatches}")


def launched_world_size() -> int:
    """Processes in this job as ``torchrun`` (or ``srun`` with the torchrun variables) set them; 1
    otherwise. Here, beside the degrees, not in ``mesh``: the CLI asks it of every verb, and this
    module does not import torch."""
    return int(os.environ.get("WORLD_SIZE", "1"))
