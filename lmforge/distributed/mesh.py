"""The device mesh of a run: its layout, the checks that it can work, and the process group.

Mesh dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (tensor
parallel innermost, so its heavy collectives stay between neighbouring devices of a
node). Every impossible layout is found by ``check_layout`` before any work starts.
Each rank of a launched job stops when its launcher (torchrun's agent) dies.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.distributed.config import ParallelConfig, launched_world_size

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(InputError):
    """A parallel layout that cannot work; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    """Resolved degrees (``dp_shard: -1`` replaced by its value)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def __str__(self) -> str:
        return f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} x pp={self.pp}"


def resolve_layout(cfg: ParallelConfig, world_size: int) -> Layout:
    """Fill in ``dp_shard: -1`` and check that the degrees multiply to ``world_size``."""
    others = cfg.dp_replicate * cfg.tp * cfg.pp
    if cfg.dp_shard == -1:
        if world_size % others:
            raise LayoutError(
                f"parallel: world size {world_size} is not divisible by dp_replicate x tp x pp = {others}; "
                f"launch a multiple of {others} processes or lower those degrees")
        return Layout(cfg.dp_replicate, world_size // others, cfg.tp, cfg.pp)
    layout = Layout(cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp)
    if layout.world_size != world_size:
        raise LayoutError(
            f"parallel: {layout} = {layout.world_size} processes, but the world size is {world_size}; "
            f"set parallel.dp_shard=-1 to fill the world, or launch {layout.world_size} processes")
    return layout


def stage_layer_ranges(n_layers: int, pp: int) -> list[range]:
    """Layers of each pipeline stage. The embedding and the output head count as one layer each
    (Llama 3's layout: 126 layers on 16 stages are embedding + 7, 14 x 8, 7 + head), so that
    every stage carries the same weight; ``n_layers + 2`` must divide by ``pp``."""
    if pp == 1:
        return [range(n_layers)]
    units = (n_layers + 2) // pp
    ranges, start = [], 0
    for stage in range(pp):
        size = units - (stage == 0) - (stage == pp - 1)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_layout(layout: Layout, cfg: ParallelConfig, model, micro_batch_size: int) -> None:
    """Every reason this layout cannot train ``model`` (a ModelConfig), in one error."""
    problems = []
    tp, pp = layout.tp, layout.pp
    if tp > 1:
        for name in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"):
            value = getattr(model, name)
            if value % tp:
                divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                problems.append(f"model.{name}={value} is not divisible by parallel.tp={tp} "
                                f"(tp must divide it: one of {divisors[:12]})")
    if pp > 1:
        units = model.n_layers + 2
        if units % pp or units // pp < 2:
            fits = [p for p in range(2, units // 2 + 1) if units % p == 0]
            problems.append(
                f"model.n_layers={model.n_layers} cannot be split into parallel.pp={pp} equal stages (the embedding and "
                f"the output head count as one layer each: n_layers + 2 = {units} must be a multiple of pp, with at least "
                f"2 per stage); use pp in {fits or [1]} or n_layers = {pp * max(2, -(-units // pp)) - 2}")
        if model.tie_embeddings:
            problems.append("model.tie_embeddings=true cannot be split across pipeline stages (the embedding is on the "
                            "first stage, the output head on the last); set model.tie_embeddings=false or parallel.pp=1")
        m = cfg.pp_microbatches or pp
        if m < pp:
            problems.append(f"parallel.pp_microbatches={m} is fewer than the {pp} pipeline stages, which would idle; "
                            f"set parallel.pp_microbatches to at least {pp}")
        if micro_batch_size % m:
            problems.append(f"train.micro_batch_size={micro_batch_size} is not divisible by parallel.pp_microbatches={m}; "
                            f"make the micro-batch a multiple of {m}")
        if cfg.sequence_parallel and tp > 1:
            problems.append("parallel.sequence_parallel with pipeline stages is not supported (stages exchange whole "
                            "sequences); set parallel.sequence_parallel=false")
    if tp > 1 and model.tie_embeddings and cfg.loss_parallel:
        problems.append("model.tie_embeddings=true with parallel.tp > 1 needs parallel.loss_parallel=false "
                        "(the shared matrix is split once, by vocabulary, for the embedding)")
    mtp = getattr(model, "mtp", None)
    if mtp is not None and mtp.depth and (tp > 1 or pp > 1):
        problems.append(f"model.mtp.depth={mtp.depth} trains with FSDP only: tensor and pipeline parallelism split the "
                        "model's layers, not the multi-token prediction modules after them; set parallel.tp=1 and "
                        "parallel.pp=1, or model.mtp.depth=0")
    if problems:
        raise LayoutError(f"parallel layout {layout} cannot train this model:\n  - " + "\n  - ".join(problems))


@dataclass
class ParallelContext:
    """The mesh of a distributed run and what each part of the code needs from it."""

    cfg: ParallelConfig
    layout: Layout
    mesh: DeviceMesh
    device: torch.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def is_logging_rank(self) -> bool:
        """Only global rank 0 writes metrics, logs and the files of a checkpoint beside its shards."""
        return self.rank == 0

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
        if self.layout.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @cached_property
    def dp_flat(self) -> DeviceMesh:
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        return self.dp_flat.get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    def all_reduce_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (in place, returned for convenience)."""
        if self.layout.dp > 1:
            dist.all_reduce(value, group=self.dp_flat.get_group())
        return value

    def all_reduce_pp(self, value: torch.Tensor) -> torch.Tensor:
        if self.layout.pp > 1:
            dist.all_reduce(value, group=self.pp_group)
        return value


def data_parallel_rank(ctx: ParallelContext | None) -> tuple[int, int]:
    """This process's data-parallel rank and the data-parallel degree: (0, 1) in one process."""
    return (ctx.dp_rank, ctx.layout.dp) if ctx is not None else (0, 1)


_watchdog: threading.Thread | None = None


def exit_when_parent_dies(poll_s: float = 1.0) -> threading.Thread:
    """Stop this process once the process that launched it is gone. A killed torchrun agent
    cannot stop its workers, which would otherwise train (and write checkpoints) to the end.
    A daemon thread watches for the parent to change (the orphan is adopted by another
    process), then sends this process SIGTERM, and exits outright if that was caught.
    (``PR_SET_PDEATHSIG`` would fire when the launching *thread* ends, not the agent.)"""
    global _watchdog
    if _watchdog is not None:
        return _watchdog
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("the launcher of this process (pid %d) is gone: stopping rank %s (pid %d)", parent,
                  os.environ.get("RANK", "?"), os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        os._exit(1)

    _watchdog = threading.Thread(target=watch, name="lmforge-launcher-watchdog", daemon=True)
    _watchdog.start()
    return _watchdog


def init_parallel(cfg: ParallelConfig, device_name: str = "auto") -> ParallelContext | None:
    """Start the process group and build the mesh; ``None`` for a plain single-process run.

    A single process with the default config changes nothing. Call ``check_layout`` on the
    returned layout before building anything large.
    """
    world_size = launched_world_size()
    if world_size == 1 and not dist.is_initialized():
        resolve_layout(cfg, 1)  # a layout asking for more processes is an error here
        return None
    layout = resolve_layout(cfg, world_size)
    if world_size > 1:  # launched by torchrun (or srun): not the tests' in-process group
        exit_when_parent_dies()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{local_rank}") if device_name == "cuda" else torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = cfg.backend
    if backend == "auto":  # NCCL for GPU tensors, gloo beside it for CPU ones (async checkpoint staging)
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    mesh = init_device_mesh(device.type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp), mesh_dim_names=MESH_DIMS)
    return ParallelContext(cfg, layout, mesh, device)


@contextlib.contextmanager
def parallel_session(cfg: ParallelConfig, device_name: str = "auto") -> Iterator[ParallelContext]:
    """``init_parallel`` for one stage's run on a rank of a ``torchrun`` job: ranks other than 0
    log warnings only; at the end every rank waits for the others (rank 0 writes last), and a
    process group this call started is destroyed (one the caller had started, as the tests'
    worker does, is left to it)."""
    created = not dist.is_initialized()
    ctx = init_parallel(cfg, device_name)
    if not ctx.is_logging_rank:
        log.setLevel(logging.WARNING)
    try:
        yield ctx
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
