"""Pipeline parallelism with ``torch.distributed.pipelining``: a model split into stages by layers.

Each pipeline rank keeps one stage: the built model itself with the blocks it does not own
removed (as torchtitan does; the first stage also embeds, the last also normalises and projects
to logits), whose own forward runs a GPipe or 1F1B schedule that splits each micro-batch into
``pp_microbatches`` pieces. Parameter names are those of the whole model, so sharded
checkpoints load into any layout. The split is the model's ``keep_layers``, called through the
module: this layer sits below ``model/`` and imports nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lmforge.distributed.mesh import stage_layer_ranges


def split_into_stage(model: nn.Module, pp_rank: int, pp: int) -> nn.Module:
    """``model`` (a ``Transformer``) cut down, in place, to pipeline stage ``pp_rank`` of ``pp``."""
    ranges = stage_layer_ranges(model.cfg.n_layers, pp)
    return model.keep_layers(ranges[pp_rank], embed=pp_rank == 0, head=pp_rank == pp - 1)


class StageLoss:
    """The last stage's loss of one pipeline micro-batch: summed loss / ``divisor`` x ``scale``
    (both set per step; ``scale`` is fp16's loss scale, a power of two)."""

    def __init__(self, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_sum = loss_sum
        self.divisor = 1.0
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(output, target) / self.divisor * self.scale


class PipelineRunner:
    """Runs a pipeline schedule over the loop's micro-batches on this rank's stage.

    ``split(batch) -> (inputs, targets)`` and ``loss_sum(output, targets)`` come from the
    objective (for pre-training: shifted windows and the summed cross-entropy);
    ``count_bytes(targets)`` gives bytes for bits per byte in evaluation.
    """

    def __init__(self, stage_module: nn.Module, ctx, n_microbatches: int, split: Callable,
                 loss_sum: Callable, count_bytes: Callable | None = None):
        self.ctx, self.split, self.count_bytes = ctx, split, count_bytes
        self.pp, self.rank = ctx.layout.pp, ctx.pp_rank
        self.loss = StageLoss(loss_sum)
        stage = PipelineStage(stage_module, self.rank, self.pp, ctx.device, group=ctx.pp_group)
        schedule = ScheduleGPipe if ctx.cfg.pp_schedule == "gpipe" else Schedule1F1B
        # scale_grads=False: the loss is already divided by the step's target count
        self.schedule = schedule(stage, n_microbatches=n_microbatches, loss_fn=self.loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.pp - 1

    def _run(self, batch: torch.Tensor, train: bool) -> torch.Tensor:
        """Loss sum (over micro-batches, divided as set) on the last stage; 0 elsewhere."""
        inputs, targets = self.split(batch.to(self.ctx.device))
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        target = targets if self.is_last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses)
        if not self.is_last:
            return torch.zeros((), device=self.ctx.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def train_batch(self, batch: torch.Tensor, divisor: float, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one loop micro-batch, the backward of the loss times ``scale``
        (fp16's loss scale); returns its loss sum / divisor, unscaled (last stage)."""
        self.loss.divisor, self.loss.scale = divisor, scale
        return self._run(batch, train=True) / scale

    def eval_batch(self, batch: torch.Tensor) -> tuple[float, int]:
        """(loss sum, bytes of the targets) of one batch, known on every pipeline rank."""
        self.loss.divisor, self.loss.scale = 1.0, 1.0
        with torch.no_grad():
            loss_sum = self.ctx.all_reduce_pp(self._run(batch, train=False))
        n_bytes = self.count_bytes(self.split(batch)[1]) if self.count_bytes is not None else 0
        return float(loss_sum), n_bytes
