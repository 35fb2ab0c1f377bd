"""Validation: the mean loss per target, the objective's metrics and bits per byte over
validation batches, per dataset of a mixture (``ValidationSet``), and when the loop runs it
(``Evaluator``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lmforge.core.run import log
from lmforge.distributed.mesh import ParallelContext
from lmforge.distributed.parallelize import reshard
from lmforge.distributed.pipeline import PipelineRunner
from lmforge.objectives.base import Objective
from lmforge.train.forward import autocast_context, batch_rows, local_value, loss_context, to_device


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches: Iterator, device: torch.device, precision: str,
             max_batches: int | None, parallel: ParallelContext | None = None,
             pipeline: PipelineRunner | None = None) -> dict:
    """Mean loss per target (nats), the objective's metrics as ``val_<name>``, and bits per byte
    when the objective counts bytes.

    ``max_batches`` counts micro-batches over all data-parallel ranks (``TrainConfig.eval_batches``;
    each rank takes its share rounded up), so the figure covers the same rows whatever the world
    size when it is a multiple of theirs. Distributed, each data-parallel
    rank evaluates its rows and the sums are added up; only whole global batches are evaluated
    (every rank must run the same forwards), so a last partial batch that a single process
    would include is left out.
    """
    if parallel is not None and max_batches is not None:
        max_batches = -(-max_batches // parallel.layout.dp)  # this rank's share, rounded up
    was_training = model.training
    model.eval()
    loss_sum, n_targets, n_bytes = 0.0, 0, 0
    metric_sums: dict[str, float] = {}
    full_rows = None
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        if parallel is not None:
            rows = torch.tensor(batch_rows(batch), device=device)
            dist.all_reduce(rows, op=dist.ReduceOp.MIN)
            full_rows = full_rows or int(rows)
            if int(rows) == 0 or int(rows) < full_rows:
                left = torch.tensor(batch_rows(batch), device=device)
                dist.all_reduce(left)  # said, not dropped silently: rank 0 logs it
                if int(left) and parallel.is_logging_rank:
                    log.warning("validation: the last, partial global batch (%d rows over the data-parallel ranks) is "
                                "left out under torchrun (every rank must run the same forwards); a validation set "
                                "that is a multiple of micro_batch_size x ranks is evaluated whole", int(left))
                break
        if batch_rows(batch) == 0:
            continue
        if pipeline is not None:
            with autocast_context(device, precision):
                batch_loss, batch_bytes = pipeline.eval_batch(batch)
            loss_sum += batch_loss
            n_targets += objective.num_targets(batch)
            n_bytes += batch_bytes
            continue
        with autocast_context(device, precision), (loss_context(parallel) if parallel else contextlib.nullcontext()):
            out = objective(model, to_device(batch, device))
        loss_sum += local_value(out.loss_sum).item()
        n_targets += out.n_targets
        n_bytes += out.n_bytes or 0
        for name, value in out.metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + float(local_value(value))
    model.train(was_training)
    if parallel is not None:
        reshard(model)
        names = sorted(metric_sums)
        sums = parallel.all_reduce_dp(torch.tensor([loss_sum, n_targets, n_bytes, *[metric_sums[k] for k in names]],
                                                   dtype=torch.float64, device=device))
        loss_sum, n_targets, n_bytes = float(sums[0]), int(sums[1]), int(sums[2])
        metric_sums = {k: float(v) for k, v in zip(names, sums[3:])}
    if n_targets == 0:
        return {}
    result = {"val_loss": loss_sum / n_targets}
    result.update({f"val_{name}": value / n_targets for name, value in metric_sums.items()})
    if n_bytes:
        result["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
    return result


@dataclass
class ValidationSet:
    """The validation batches of one dataset of a mixture (``batches()``: a fresh pass) and its
    mixture weight; its figures are logged as ``val/<name>/<metric>`` (``val/web/loss``)."""

    name: str
    batches: Callable[[], Iterator]
    weight: float = 1.0


def is_validation_metric(key: str) -> bool:
    """A record key that evaluation wrote: ``val_loss``, ``val_bpb``, ``val/<name>/loss`` ..."""
    return key.startswith(("val_", "val/"))


def is_scored_metric(key: str) -> bool:
    """A record key that the stage's scorer wrote: ``eval/<task>/<metric>`` (``train.eval_tasks``)."""
    return key.startswith("eval/")


def combine_domains(results: list[tuple[ValidationSet, dict]]) -> dict:
    """Each set's ``val_<metric>`` as ``val/<name>/<metric>``, and ``val_<metric>`` the mean of the
    sets' figures weighted by their mixture weights (over the sets that have it): the loss on the
    mixture the run trains on, each domain counting by its weight, not by its validation size."""
    out: dict = {}
    totals: dict[str, list[float]] = {}  # val_<metric>: [weighted sum, weight]
    for vset, result in results:
        for key, value in result.items():
            out[f"val/{vset.name}/{key.removeprefix('val_')}"] = value
            total = totals.setdefault(key, [0.0, 0.0])
            total[0] += vset.weight * value
            total[1] += vset.weight
    return {**{key: s / w for key, (s, w) in totals.items()}, **out}


class Evaluator:
    """When the loop validates and on what: every ``every`` steps (0: never in between), at the
    last step and before a stop, over a fresh pass of ``val_batches()`` (None: no validation)
    through ``run(batches, max_batches)``, the step runner's ``evaluate``.

    ``val_batches`` a list of ``ValidationSet`` (a mixture) evaluates each set over up to
    ``max_batches`` micro-batches (the same rows of a dataset whatever else the mixture holds,
    so its figure compares across mixtures; an evaluation costs up to ``len(sets) * max_batches``
    forwards) and logs ``combine_domains`` of them. ``score()`` (the stage's scorer of the model,
    e.g. its ``train.eval_tasks``) runs on the same steps, with or without validation batches."""

    def __init__(self, val_batches: Callable[[], Iterator] | list[ValidationSet] | None, every: int,
                 max_batches: int | None, run: Callable[[Iterator, int | None], dict],
                 score: Callable[[], dict] | None = None):
        self.val_batches = val_batches or None  # no set at all: no validation
        self.every, self.max_batches, self.run, self.score = every, max_batches, run, score

    def due(self, done: int, final: bool) -> bool:
        """Whether to validate after ``done`` steps; ``final``: the last step, or the run stops there."""
        something = self.val_batches is not None or self.score is not None
        return something and ((self.every > 0 and done % self.every == 0) or final)

    def __call__(self) -> dict:
        if self.val_batches is None:
            out = {}
        elif isinstance(self.val_batches, list):
            out = combine_domains([(s, self.run(s.batches(), self.max_batches)) for s in self.val_batches])
        else:
            out = self.run(self.val_batches(), self.max_batches)
        return {**out, **(self.score() if self.score is not None else {})}
