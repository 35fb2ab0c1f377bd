"""Asynchronous rollouts with bounded staleness: rollout worker processes that sample and score
groups continuously while the trainer trains, and the trainer's side of them (``AsyncRolloutBatches``).

**Processes.** ``rl.rollout_workers`` W >= 1 processes (``torch.multiprocessing``, spawn), each
with its own plain copy of the policy (LoRA layers included) and the inference engine. The
trainer owns the prompt order (``RolloutState``): it sends *tasks* ``(group id, epoch, prompt
index)`` into one task queue, a worker takes them, submits each to its engine (continuous
batching: new tasks join the batch while others decode), scores a group with the recipe's
reward as soon as its ``n`` samples finish and puts it into the result queue.

**Weights.** After each optimizer step (when the loop asks for the next step's first
micro-batch, the model holds every step before it) the trainer copies the policy's state dict
into one shared-memory copy (``WeightChannel``: CPU tensors made ``share_memory_()`` once, a lock
and a version counter, the number of optimizer steps the weights have had). A worker compares
the counter with its own between engine steps and copies the new weights into its model. Across
machines the same design holds with ``torch.distributed``: the trainer's rank broadcasts the
state dict over a process group of itself and the rollout ranks (NCCL between GPUs, gloo on
CPUs; ``dist.broadcast`` per tensor, or ``broadcast_object_list`` of the version first), each
rollout rank polling for a new version between engine steps; the task and result queues become
point-to-point ``send_object_list``/``recv_object_list`` messages (or a small TCP store). Only the
shared-memory transport is built here (one machine; ``torchrun`` data parallelism keeps
in-process sampling).

**Staleness.** A sample's *version* is that of the weights that produced it (the oldest of its
tokens, below). At optimizer step s (the model has version s) a group of version v is
``s - v`` steps off-policy; one past ``rl.max_off_policy_steps`` k is dropped, counted
(``stale_dropped`` in metrics.jsonl) and its prompt sent again (the same seed: its group is
regenerated under newer weights, so no prompt is lost). The trainer keeps k rollout batches'
prompts in flight beyond the one it is drawing (prime-rl's ``max_off_policy_steps``/
``async_level``; verl's one-step-off trainer is k = 1), so with k >= 1 the workers sample the
next batches while the trainer trains. k = 0 sends a batch's prompts only once its weights are
published and waits for them: the synchronous run, and with one worker the same rollouts (the
same seeds, one engine over the same requests) and so the same losses, bit for bit, as
in-process sampling (``rl.rollout_workers: 0``) on as many threads (``tests/stages/test_grpo_async.py``).

**Partial rollouts.** New weights can arrive while a worker's requests are decoding.
``rl.partial_rollouts: continue`` (PipelineRL's and prime-rl's in-flight updates) loads them
between two decode steps and decodes on: the tokens chosen after it come from the new
weights (the KV cache of the earlier tokens stays, computed by the old ones), and each response
token carries the version that produced it (``Rollout.versions``); the engine's log-prob of
each token is that of the weights that drew it, which is what ``rl.old_logprobs: engine`` and
the rollout correction (``rl.rollout_correction``, ``rl.correction``) compare the trainer's
with. ``discard`` cancels the requests that were decoding and starts them again under the new
weights (the same seed), so every token of a sample has one version.

**Resume.** The checkpoint keeps the prompt cursor (``RolloutState``) and the tasks in flight
(sent, or received and not yet trained on); a resumed run sends those first, so their groups
are regenerated, then continues the order: every prompt is trained on once (``tests``: a
``kill -9`` of the trainer, then ``train.resume``). An asynchronous run is not bit-reproducible
(which weights a sample meets depends on timing), a synchronous one is.

**Failures.** A worker that raises sends its traceback and the trainer stops with
``RolloutWorkerError`` naming the worker and the error; one that dies (killed, out of memory)
is found by the trainer's wait, which polls the workers every ``POLL_S`` seconds: the run stops
with its exit code, never hangs. Workers poll their parent in turn and exit when it is gone.

**Threads.** Each worker runs ``rl.worker_threads`` torch threads (0: the trainer's thread
count split evenly over trainer and workers, at least 1 each) and the trainer keeps the rest,
so W workers and the trainer do not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from torch import nn

from lmforge.checkpoints.files import load_weights
from lmforge.core.config import ConfigError
from lmforge.core.run import RunStopped
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Engine, Request, decoding_view
from lmforge.model.families import build as build_model
from lmforge.peft.lora import LoraConfig, apply_lora
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import Reward, RewardConfig
from lmforge.rl.rollout import Rollout, RolloutConfig, request_seed, rollout_of, stop_ids_for
from lmforge.rl.trainer import RolloutBatches, ScoredGroup

log = logging.getLogger("lmforge")
POLL_S = 0.5  # how often a waiting trainer checks that its workers live, and a waiting worker its parent
Task = tuple[int, int, int]  # (group id, epoch, prompt index)


class RolloutWorkerError(RunStopped):
    """A rollout worker raised or died: the run stops (resume it from its checkpoint); one line on the command line."""


def worker_threads(workers: int, requested: int, total: int) -> tuple[int, int]:
    """(threads per worker, threads left to the trainer) for ``workers`` workers over ``total`` threads:
    ``requested`` per worker, or with 0 an even split of the trainer and the workers, at least 1 each."""
    per = requested if requested > 0 else max(1, total // (workers + 1))
    return per, max(1, total - workers * per)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's state dict under the names a plain built model has (a compiled block's ``_orig_mod.`` dropped)."""
    return {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}


class WeightChannel:
    """The trainer's weights in shared memory: one CPU copy of the state dict, a lock and a version counter."""

    def __init__(self, model: nn.Module, ctx):
        self.tensors = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in state_of(model).items()}
        self.version = ctx.Value("q", -1, lock=False)
        self.lock = ctx.Lock()

    def publish(self, model: nn.Module, version: int) -> None:
        with torch.no_grad(), self.lock:
            for k, v in state_of(model).items():
                self.tensors[k].copy_(v)
            self.version.value = version


@dataclass
class WorkerSpec:
    """What a worker builds its policy, engine and reward from (pickled once, at spawn)."""

    model_cfg: object
    lora: LoraConfig | None
    tok: Tokenizer
    prompts: list[Prompt]
    rollout: RolloutConfig
    reward: RewardConfig
    partial: str
    threads: int
    device: str


@dataclass
class Job:
    task: Task
    request: int
    restarts: int = 0
    start_version: int = 0
    segments: dict[int, list[tuple[int, int]]] | None = None  # sample -> [(first token, version)] after the first


def versions_of(job: Job, sample: int, length: int) -> list[int]:
    """The version of each of a sample's ``length`` response tokens (the stop token included)."""
    out, bounds = [job.start_version] * length, (job.segments or {}).get(sample, [])
    for first, version in bounds:
        for i in range(min(first, length), length):
            out[i] = version
    return out


def run_worker(wid: int, spec: WorkerSpec, tensors: dict, version, lock, tasks, results) -> None:
    """A rollout worker's process: sample the tasks it takes, score each group, put it in ``results``."""
    torch.set_num_threads(spec.threads)
    try:
        serve_tasks(wid, spec, tensors, version, lock, tasks, results)
    except BaseException:  # noqa: BLE001 - the trainer reports it and stops
        with contextlib.suppress(Exception):
            results.put(("error", wid, traceback.format_exc()))


def serve_tasks(wid: int, spec: WorkerSpec, tensors: dict, version, lock, tasks, results) -> None:
    device = torch.device(spec.device)
    with torch.device("meta"):
        model = build_model(spec.model_cfg)
        if spec.lora is not None:
            apply_lora(model, spec.lora)
    model = model.to_empty(device=device).requires_grad_(False).eval()
    reward = Reward(spec.reward, spec.tok, spec.rollout.max_new_tokens, device)
    engine = Engine(model, spec.tok, max_batch=spec.rollout.max_batch)
    parent = mp.parent_process()
    mine, jobs = -1, {}  # request id -> Job

    def submit(task: Task, restarts: int, version: int) -> None:
        _, epoch, index = task
        prompt = spec.prompts[index]
        generator = torch.Generator(device).manual_seed(request_seed(spec.rollout.seed, epoch, index))
        request = Request(prompt.ids, spec.rollout.generation(stop_ids_for(prompt, spec.rollout, spec.tok)), generator)
        rid = engine.submit(request)
        jobs[rid] = Job(task, rid, restarts, version)

    results.cancel_join_thread()  # an exit never waits on groups the trainer will not read
    while True:
        try:  # new tasks (waiting for them when idle), then the weights they are sampled with
            message = tasks.get(timeout=POLL_S) if not jobs else tasks.get_nowait()
        except queue.Empty:
            message = None
            if parent is not None and not parent.is_alive():
                return
        if message == "stop":
            return
        if version.value != mine:
            with torch.no_grad(), lock:
                load_weights(model, tensors, where="the trainer's published weights")
                mine = int(version.value)
            engine.net = decoding_view(model)  # the engine's decoding layout of the new weights
            update_jobs(engine, jobs, mine, spec.partial, submit)
        if message is not None:
            for task in message:
                submit(tuple(task), 0, mine)
        if not jobs:
            continue
        with torch.inference_mode():
            finished = engine.step()
        for _, error in engine.take_failures():
            raise error
        for rid, generations in finished:
            job = jobs.pop(rid)
            group, _, index = job.task
            rollouts = [rollout_of(spec.prompts[index], group, sample, g) for sample, g in enumerate(generations)]
            for sample, r in enumerate(rollouts):
                r.versions = versions_of(job, sample, len(r.response_ids))
            scores = reward(rollouts)
            results.put(("group", wid, {
                "task": job.task, "restarts": job.restarts, "totals": scores.total, "terms": scores.terms,
                "samples": [(r.response_ids, r.logprobs, r.finish_reason, r.text, r.versions) for r in rollouts]}))


def update_jobs(engine: Engine, jobs: dict[int, Job], newest: int, partial: str, submit) -> None:
    """New weights (version ``newest``) met the worker's requests: a queued one is prefilled by them;
    a decoding one continues under them (``continue``: its later tokens tagged ``newest``) or is
    cancelled and submitted again (``discard``)."""
    running = {row.request for row in engine.rows}
    for rid in list(jobs):
        job = jobs[rid]
        if rid not in running:
            job.start_version = newest
        elif partial == "continue":  # the next token still comes from the old weights' logits
            job.segments = job.segments or {}
            for row in engine.rows:
                if row.request == rid:
                    job.segments.setdefault(row.sample, []).append((len(row.tokens) + 1, newest))
        else:
            engine.cancel(rid)
            del jobs[rid]
            submit(job.task, job.restarts + 1, newest)


class WorkerPool:
    """The trainer's handle on its workers: spawn, send tasks, receive groups, watch them live, stop them."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, workers: int, trainer_threads: int):
        self.ctx = mp.get_context("spawn")
        self.channel = WeightChannel(model, self.ctx)
        self.tasks, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads)
        self.procs = []
        for wid in range(workers):
            p = self.ctx.Process(target=run_worker, name=f"lmforge-rollout-{wid}", daemon=True,
                                 args=(wid, spec, self.channel.tensors, self.channel.version, self.channel.lock,
                                       self.tasks, self.results))
            p.start()
            self.procs.append(p)
        self._finalizer = weakref.finalize(self, stop_workers, self.procs, self.tasks)

    def publish(self, model: nn.Module, version: int) -> None:
        if self.channel.version.value != version:
            self.channel.publish(model, version)

    def send(self, tasks: Sequence[Task]) -> None:
        """The tasks in one message per worker (contiguous shares), so each worker's engine batches its share."""
        share = -(-len(tasks) // len(self.procs))
        for first in range(0, len(tasks), share):
            self.tasks.put([list(t) for t in tasks[first : first + share]])

    def receive(self, block: bool = True) -> dict | None:
        """The next scored group (None when ``block`` is False and none is ready); a worker's error, or
        its death, raises ``RolloutWorkerError``."""
        while True:
            try:
                kind, wid, payload = self.results.get(timeout=POLL_S) if block else self.results.get_nowait()
            except queue.Empty:
                self.check_alive()
                if not block:
                    return None
                continue
            if kind == "error":
                log.error("rollout worker %d failed:\n%s", wid, payload)
                last = payload.strip().splitlines()[-1]
                raise RolloutWorkerError(f"rollout worker {wid} failed: {last}: the run stops; resume it "
                                         f"(train.resume=auto) from its last checkpoint, whose prompts in flight "
                                         f"are sampled again")
            return payload

    def check_alive(self) -> None:
        for wid, p in enumerate(self.procs):
            if not p.is_alive():
                raise RolloutWorkerError(f"rollout worker {wid} (pid {p.pid}) died with exit code {p.exitcode}: the "
                                         f"run stops; resume it (train.resume=auto) from its last checkpoint, whose "
                                         f"prompts in flight are sampled again")

    def close(self) -> None:
        self._finalizer()
        torch.set_num_threads(self.threads_before)


def stop_workers(procs: list, tasks) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                tasks.put("stop")
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


class AsyncRolloutBatches(RolloutBatches):
    """``RolloutBatches`` whose groups come from rollout workers (module docstring): the same rounds of
    ``zero_variance: drop``, the same batch layout, scoring forwards and estimates; ``max_off_policy_steps``
    bounds a group's age, and the checkpoint holds the tasks in flight."""

    def __init__(self, *args, spec: WorkerSpec, workers: int, max_off_policy_steps: int, trainer_threads: int,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if self.dp > 1:
            raise ConfigError("rl.rollout_workers: asynchronous rollouts run in one process; under torchrun "
                              "each rank samples in-process (rl.rollout_workers=0)")
        if self.critic is not None:
            raise ConfigError("rl.rollout_workers: asynchronous rollouts are grpo's; ppo samples in-process")
        self.spec, self.workers, self.max_off, self.trainer_threads = spec, workers, max_off_policy_steps, trainer_threads
        self.pool: WorkerPool | None = None
        self.resend: list[Task] = []  # tasks to send first: a resumed run's in flight, or stale groups
        self.in_flight: dict[int, Task] = {}  # group id -> task, sent and not yet received
        self.ready: dict[int, dict] = {}  # group id -> payload, received and not yet trained on
        self.figures: dict[str, float] = {}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __next__(self) -> dict[str, torch.Tensor]:
        boundary = self.drawn % self.grad_accum == 0  # a new optimizer step: every earlier one is in the weights
        step = self.drawn // self.grad_accum
        if boundary:
            if self.pool is None:
                self.pool = WorkerPool(self.model, self.spec, self.workers, self.trainer_threads)
            self.pool.publish(self.model, step)
        batch = super().__next__()
        if boundary:
            self.prefetch(step)
        return batch

    def prefetch(self, step: int) -> None:
        """Keep in flight the prompts of every rollout batch drawn within ``max_off_policy_steps`` steps
        after ``step`` (batches are drawn every ``updates_per_batch * minibatches`` steps): sampled from
        now on, by weights of version ``step`` or newer, they are at most that old when trained on."""
        every = self.cfg.updates_per_batch * self.cfg.minibatches
        batches = (step + self.max_off) // every - step // every
        self.send(batches * self.per_rank - len(self.in_flight) - len(self.ready))

    def send(self, k: int) -> None:
        if k <= 0:
            return
        tasks = self.resend[:k]
        del self.resend[:k]
        tasks += self.state.take(k - len(tasks))
        for task in tasks:
            self.in_flight[task[0]] = task
        self.pool.send(tasks)

    def take(self, payload: dict) -> None:
        task = tuple(payload["task"])
        self.in_flight.pop(task[0], None)
        self.ready[task[0]] = payload

    def pull(self, need: int, step: int) -> list[ScoredGroup]:
        """``need`` groups at most ``max_off_policy_steps`` old, the lowest group ids first; stale ones are
        dropped, counted and sent again."""
        while True:
            while (payload := self.pool.receive(block=False)) is not None:
                self.take(payload)
            for gid in sorted(self.ready):
                payload = self.ready[gid]
                if step - min(min(s[4]) for s in payload["samples"]) > self.max_off:
                    del self.ready[gid]
                    self.figures["stale_dropped"] += 1
                    self.resend.insert(0, tuple(payload["task"]))
            if len(self.ready) >= need:
                break
            self.send(need - len(self.ready) - len(self.in_flight))
            self.take(self.pool.receive())
        chosen = sorted(self.ready)[:need]
        return [self.scored(self.ready.pop(gid)) for gid in chosen]

    def scored(self, payload: dict) -> ScoredGroup:
        group, _, index = payload["task"]
        prompt = self.prompts[index]
        rollouts = []
        for sample, (ids, logprobs, finish, text, versions) in enumerate(payload["samples"]):
            rollouts.append(Rollout(prompt, group, sample, list(ids), list(logprobs), finish, text, list(versions)))
        self.figures["partial_restarts"] += payload["restarts"]
        return ScoredGroup(rollouts, list(payload["totals"]), {k: list(v) for k, v in payload["terms"].items()})

    def draw_groups(self) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
        step = self.drawn // self.grad_accum
        began = time.perf_counter()
        self.figures = {"stale_dropped": 0.0, "partial_restarts": 0.0}
        target, kept, dropped, sampled = self.per_rank, [], [], []
        for _ in range(1 + (self.cfg.max_refills if self.cfg.zero_variance == "drop" else 0)):
            need = target - len(kept)
            if not need:
                break
            for scored in self.pull(need, step):
                sampled.append(scored)
                (dropped if self.cfg.zero_variance == "drop" and scored.zero_variance else kept).append(scored)
        self.timed("rollout", began)
        trained = kept + dropped[: target - len(kept)]
        ages = [step - min(r.versions) for g in trained for r in g.rollouts]
        self.figures |= {"off_policy_steps_mean": sum(ages) / len(ages), "off_policy_steps_max": float(max(ages)),
                         "partial_share": sum(len(set(r.versions)) > 1 for g in trained for r in g.rollouts) / len(ages)}
        return trained, sampled

    def statistics(self, sampled: list[ScoredGroup], trained: list[ScoredGroup]) -> dict[str, float]:
        return super().statistics(sampled, trained) | self.figures

    def state_dict(self) -> dict:
        """The base's, and the tasks in flight (sent, or received and not trained on), to send first on resume."""
        pending = list(self.resend) + list(self.in_flight.values()) + [tuple(p["task"]) for p in self.ready.values()]
        return super().state_dict() | {"in_flight": sorted([list(t) for t in pending])}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.resend = [tuple(t) for t in state.get("in_flight", [])]
        self.in_flight, self.ready = {}, {}


def async_batches(recipe, model: nn.Module, tok: Tokenizer, prompts: Sequence[Prompt], device, reward: Reward,
                  micro_batch_size: int, **kwargs) -> AsyncRolloutBatches:
    """A grpo recipe's ``AsyncRolloutBatches``: ``recipe.rl.rollout_workers`` workers, the threads split."""
    rl = recipe.rl
    per, left = worker_threads(rl.rollout_workers, rl.worker_threads, torch.get_num_threads())
    spec = WorkerSpec(model.cfg, recipe.lora, tok, list(prompts), recipe.rollout, recipe.reward, rl.partial_rollouts,
                      per, str(device))
    return AsyncRolloutBatches(model, tok, prompts, recipe.rollout, recipe.grpo, recipe.objective, reward,
                               micro_batch_size, spec=spec, workers=rl.rollout_workers,
                               max_off_policy_steps=rl.max_off_policy_steps, trainer_threads=left, **kwargs)
