"""Differentially private training (DP-SGD, Abadi et al. 2016): the recipe's ``dp:`` keys, the
privacy accountant, and the step runner whose backward clips each example's gradient.

One DP-SGD step over a Poisson-sampled batch B (each training example in it with probability
q = expected batch / N, ``data.poisson.PoissonRowLoader``):

    g̃ = ( Σ_{i ∈ B} g_i · min(1, C / ‖g_i‖₂)  +  N(0, σ² C² I) ) / (q N)

where g_i = ∇θ ℓ_i is example i's gradient (its loss the mean over its own targets), C is
``dp.max_grad_norm`` and σ the noise multiplier. The divisor is the expected batch, never the
drawn one, which would depend on the data. The per-example gradients come from
``torch.func.vmap(grad(...))`` over the model's one forward (``functional_call``); the privacy
spent, ε at ``dp.delta`` after the steps taken, from Opacus's accountants (RDP, Mironov 2017;
PRV, Gopi et al. 2021), as does σ for a target ε over the planned steps (``get_noise_multiplier``).

The step is the plain step runner's with its backward replaced (``DPStepRunner``): the loop, its
checkpoints (the accountant's history is in ``trainer_state.json``), logging and evaluation are
the same. The noise of step k is drawn from a generator seeded by (``dp.seed``, k), so a resumed
run draws what an uninterrupted one would.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from lmforge.core.config import ConfigError, at_least, option, positive, seed_field
from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.data.packing import IGNORE_INDEX
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.base import Objective
from lmforge.objectives.clm import causal_lm_loss
from lmforge.objectives.sft import SFTObjective
from lmforge.train.forward import autocast_context, to_device
from lmforge.train.step import StepResult, StepRunner


@dataclass
class DPConfig:
    """The ``dp:`` section: DP-SGD's clipping norm, noise and privacy budget."""

    epsilon: float | None = positive(
        None, help="the privacy budget ε at dp.delta over the whole run; the noise multiplier is chosen for it over "
        "train.max_steps (unless dp.noise_multiplier is set), and training stops before spending more "
        "(dp.on_budget_exceeded). None: no budget, dp.noise_multiplier required")
    delta: float = positive(1e-5, help="δ of the (ε, δ) guarantee; must be below 1/N for N training examples")
    max_grad_norm: float = positive(1.0, help="C: each example's gradient is clipped to this L2 norm")
    noise_multiplier: float | None = at_least(
        0, None, help="σ: the noise's standard deviation over C, set by hand (0 adds none and spends an infinite ε); "
        "None: the accountant's σ for dp.epsilon")
    accountant: Literal["rdp", "prv"] = option(
        "rdp", help="Opacus's accountant: rdp (Rényi DP, Mironov 2017) or prv (privacy loss random variables, "
        "Gopi et al. 2021: a tighter ε)")
    on_budget_exceeded: Literal["stop", "warn"] = option(
        "stop", help="when the next step would spend more than dp.epsilon: stop (with a checkpoint), or warn once "
        "and go on")
    seed: int = seed_field(0, help="the seed of the Poisson sampling and of the noise")
    epsilon_tolerance: float = positive(0.01, help="how far below dp.epsilon the chosen σ's ε may fall (σ's search)")

    def __post_init__(self) -> None:
        if self.epsilon is None and self.noise_multiplier is None:
            raise ConfigError("dp: set dp.epsilon (the budget; σ is chosen for it) or dp.noise_multiplier")


def accountant_class(kind: str):
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError as exc:  # the extra `dp`
        raise ConfigError("dp: DP-SGD's accountant is Opacus's: pip install 'lmforge[dp]'") from exc
    return {"rdp": RDPAccountant, "prv": PRVAccountant}[kind]


@functools.lru_cache(maxsize=4096)  # PRV's ε takes about a second on a CPU; a run asks for each step's twice
def epsilon_spent(kind: str, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε at ``delta`` after ``steps`` steps of the subsampled Gaussian mechanism (``kind``'s accountant)."""
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = accountant_class(kind)()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    return float(accountant.get_epsilon(delta=delta))


def noise_for_budget(kind: str, epsilon: float, delta: float, sample_rate: float, steps: int,
                     tolerance: float = 0.01) -> float:
    """The smallest σ (to ``tolerance`` in ε) whose ε after ``steps`` steps is at most ``epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=kind, epsilon_tolerance=tolerance))
    except ValueError as exc:
        raise ConfigError(f"dp.epsilon = {epsilon}: {exc} (δ {delta}, q {sample_rate:.4g}, {steps} steps)") from exc


def budget_steps(kind: str, noise_multiplier: float, sample_rate: float, delta: float, epsilon: float,
                 max_steps: int) -> int:
    """The most steps (up to ``max_steps``) whose ε stays within ``epsilon``: ε grows with the steps."""
    low, high = 0, max_steps
    while low < high:
        mid = (low + high + 1) // 2
        if epsilon_spent(kind, noise_multiplier, sample_rate, mid, delta) <= epsilon:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class PrivacyPlan:
    """A run's DP-SGD, resolved before training: N examples, the expected batch, q, σ, and the
    accountant of the steps taken (its ``state_dict`` is in each checkpoint)."""

    cfg: DPConfig
    n_examples: int
    expected_batch: int
    max_steps: int
    noise_multiplier: float = 0.0
    history: list = field(default_factory=list)  # the accountant's: (σ, q, steps)
    warned: bool = False

    def __post_init__(self) -> None:
        c = self.cfg
        check_delta(c, self.n_examples)
        if self.expected_batch > self.n_examples:
            raise InputError(f"dp: the expected batch of {self.expected_batch} rows (train.micro_batch_size x "
                             f"micro-batches per step) exceeds the {self.n_examples} training examples: lower "
                             "train.batch_tokens or train.micro_batch_size")
        self.noise_multiplier = c.noise_multiplier if c.noise_multiplier is not None else noise_for_budget(
            c.accountant, c.epsilon, c.delta, self.sample_rate, self.max_steps, c.epsilon_tolerance)
        self.allowed_steps = (budget_steps(c.accountant, self.noise_multiplier, self.sample_rate, c.delta, c.epsilon,
                                           self.max_steps) if c.epsilon is not None else self.max_steps)
        if self.allowed_steps == 0:
            raise ConfigError(f"dp.noise_multiplier = {self.noise_multiplier:g} spends more than dp.epsilon = "
                              f"{c.epsilon} in one step (q = {self.sample_rate:.4g}): raise dp.noise_multiplier")
        log.info("dp: N=%d, q=%.4g (expected batch %d), σ=%.4g, C=%g; ε at δ=%g after %d steps: %.4g%s",
                 self.n_examples, self.sample_rate, self.expected_batch, self.noise_multiplier, c.max_grad_norm,
                 c.delta, self.max_steps, self.epsilon_after(self.max_steps),
                 f" (budget {c.epsilon}: {self.allowed_steps} steps)" if c.epsilon is not None else "")

    @property
    def sample_rate(self) -> float:
        return self.expected_batch / self.n_examples

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def epsilon_after(self, steps: int) -> float:
        return epsilon_spent(self.cfg.accountant, self.noise_multiplier, self.sample_rate, steps, self.cfg.delta)

    def epsilon(self) -> float:
        """ε spent so far: the accountant over its history, whose σ and q are the plan's throughout."""
        return self.epsilon_after(self.steps)

    def step(self) -> None:
        accountant = accountant_class(self.cfg.accountant)()
        accountant.history = [tuple(h) for h in self.history]
        accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.history = [list(h) for h in accountant.history]

    def over_budget(self) -> bool:
        """Would one more step spend more than ``dp.epsilon``? (stop) or warn once (warn)."""
        if self.cfg.epsilon is None or self.steps < self.allowed_steps:
            return False
        if self.cfg.on_budget_exceeded == "stop":
            return True
        if not self.warned:
            log.warning("dp: step %d spends more than dp.epsilon = %g (dp.on_budget_exceeded=warn): the run goes on "
                        "past its privacy budget", self.steps + 1, self.cfg.epsilon)
            self.warned = True
        return False

    def summary(self) -> dict:
        eps = self.epsilon()
        return {"dp": {"epsilon": eps if math.isfinite(eps) else None, "delta": self.cfg.delta,
                       "target_epsilon": self.cfg.epsilon, "noise_multiplier": self.noise_multiplier,
                       "max_grad_norm": self.cfg.max_grad_norm, "sample_rate": self.sample_rate,
                       "expected_batch": self.expected_batch, "n_examples": self.n_examples, "steps": self.steps,
                       "accountant": self.cfg.accountant, "budget_exhausted": self.steps >= self.allowed_steps
                       and self.cfg.epsilon is not None and self.steps < self.max_steps}}

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history], "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            raise InputError("the checkpoint resumed has no DP accountant state (trainer_state.json 'dp'): it was "
                             "not written by a dp run; use a new run_dir")
        if not math.isclose(state["noise_multiplier"], self.noise_multiplier) or not math.isclose(
                state["sample_rate"], self.sample_rate):
            raise InputError(f"the checkpoint resumed was trained with σ={state['noise_multiplier']:.6g}, "
                             f"q={state['sample_rate']:.6g}; this recipe gives σ={self.noise_multiplier:.6g}, "
                             f"q={self.sample_rate:.6g}: keep dp, train and data as they were, or use a new run_dir")
        self.history = [list(h) for h in state["history"]]


def check_delta(cfg: DPConfig, n_examples: int) -> None:
    """δ must be below 1/N: a δ of 1/N allows releasing one example outright."""
    if cfg.delta >= 1 / n_examples:
        raise InputError(f"dp.delta = {cfg.delta} is not below 1/N = {1 / n_examples:.3g} for the N = {n_examples} "
                         "training examples (a δ that large allows publishing an example): lower dp.delta")


def check_dp_recipe(dp: DPConfig | None, packing: bool, n_records: int | None, ewc, lora=None) -> None:
    """A DP recipe's problems found before anything is written."""
    if dp is None:
        return
    if lora is not None and lora.quantize_base:
        raise ConfigError(f"dp with lora.quantize_base={lora.quantize_base}: the quantised base's autograd function "
                          "has no torch.func rule, so no per-example gradient passes through it; set "
                          "lora.quantize_base=false")
    if packing:
        raise ConfigError("dp with data.packing=true: packing puts several examples in a row, so a row's gradient is "
                          "no one example's and per-example clipping would not bound any one's; set data.packing=false")
    if ewc is not None:
        raise ConfigError("dp with ewc: the EWC penalty's gradient is not an example's; remove ewc: or dp:")
    if n_records is not None:
        check_delta(dp, n_records)


def check_objective(objective: Objective) -> None:
    if not isinstance(objective, SFTObjective):
        raise ConfigError(f"dp: DP-SGD trains sft's objective so far, not {type(objective).__name__}")


def example_loss_sum(objective: Objective, model: Callable, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token loss of SFT rows as ``SFTObjective`` computes it, without the target
    count its ``__call__`` takes with a host sync, which vmap cannot. DP rows are never packed
    (``check_dp_recipe``), so their positions are the forward's default 0..T-1 and need no mask."""
    return causal_lm_loss(model(batch["input_ids"])[:, :-1], batch["labels"][:, 1:])


def per_example_gradients(model: nn.Module, objective: Objective, batch: dict[str, torch.Tensor],
                          params: dict[str, torch.Tensor], counts: torch.Tensor
                          ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each row's gradient of its mean loss over its targets (``counts``), and those losses:
    ``torch.func.vmap(grad)`` over the rows of ``batch`` (a dict of (B, T) tensors), each row a
    batch of one through the model's forward (``functional_call`` with ``params``, the trained
    parameters; the others are the module's own)."""
    def loss(trained: dict[str, torch.Tensor], row: dict[str, torch.Tensor], count: torch.Tensor) -> torch.Tensor:
        one = {k: v.unsqueeze(0) for k, v in row.items()}
        forward = lambda *args, **kwargs: functional_call(model, trained, args, kwargs, strict=False)  # noqa: E731
        return example_loss_sum(objective, forward, one) / count

    with warnings.catch_warnings():  # SDPA's CPU kernels have no batching rule: vmap loops them (correct, slower)
        warnings.filterwarnings("ignore", message="There is a performance drop")
        grads, losses = vmap(grad_and_value(loss), in_dims=(None, 0, 0), randomness="different")(params, batch, counts)
    return grads, losses


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or the tensor's own dtype where wider (an fp64 model in the tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def clip_factors(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(1, C / ‖g_i‖) per example, and the norms ‖g_i‖ over every parameter (Abadi et al. 2016, eq. in §3.1)."""
    norms = torch.stack([g.flatten(1).to(accumulation_dtype(g)).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    return (max_norm / (norms + 1e-6)).clamp(max=1.0), norms


def example_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The columns a DP step feeds the forward: unpacked rows need no ``position_ids`` (0..T-1, the default)."""
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def split_rows(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Chunks of ``size`` rows, each cut after its last labelled column: under the causal mask the
    padding after it changes no earlier position, and it carries no target."""
    chunks = []
    for i in range(0, len(batch["labels"]), size):
        labelled = (batch["labels"][i:i + size] != IGNORE_INDEX).any(0).nonzero()
        end = int(labelled.max()) + 1 if len(labelled) else 1
        chunks.append({k: v[i:i + size, :end] for k, v in batch.items()})
    return chunks


def privacy_line(summary: dict) -> list[str]:
    """The report's line on a DP run's guarantee: ε spent at δ, the noise, the clipping norm."""
    dp = summary.get("dp")
    if not dp:
        return []
    eps = "∞" if dp["epsilon"] is None else f"{dp['epsilon']:.3g}"
    budget = f" of the budget {dp['target_epsilon']:g}" if dp.get("target_epsilon") is not None else ""
    stopped = "; stopped at the budget" if dp.get("budget_exhausted") else ""
    return [f"- DP-SGD: **(ε = {eps}{budget}, δ = {dp['delta']:g})** after {dp['steps']} steps ({dp['accountant']} "
            f"accountant), noise σ = {dp['noise_multiplier']:.3g}, clipping C = {dp['max_grad_norm']:g}, "
            f"Poisson rate q = {dp['sample_rate']:.3g}{stopped}"]


class DPStepRunner(StepRunner):
    """The step runner of a DP-SGD run: ``backward`` sums the clipped per-example gradients of the
    step's rows (in chunks of ``train.micro_batch_size``), adds the Gaussian noise once and divides
    by the expected batch; the plain runner's optimizer step follows.

    Under torchrun (``parallel``) every rank holds the whole model (not sharded: per-example
    gradients need every weight), draws its share of the step's Poisson sample, and sums its
    clipped gradients; data-parallel rank 0 alone adds the noise before the sums are all-reduced,
    so the ranks together take the one process's step."""

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer, precision: str,
                 plan: PrivacyPlan, chunk: int, parallel: ParallelContext | None = None):
        if precision == "fp16":
            raise ConfigError("dp with train.precision=fp16: the loss scaler's skipped steps would still spend "
                              "privacy; use bf16 or fp32")
        check_objective(objective)
        if parallel is not None:
            self.parallel, self.dp, self.world_size = parallel, parallel.layout.dp, parallel.layout.world_size
        super().__init__(model, objective, optimizer, precision, grad_clip=0.0)
        self.privacy, self.chunk = plan, chunk
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    def run_device(self) -> torch.device:
        return self.parallel.device if self.parallel is not None else super().run_device()

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce_dp(value) if self.parallel is not None else value

    def tokens(self, micro_batches: list) -> int:
        local = torch.tensor(float(sum(self.objective.num_tokens(b) for b in micro_batches)), dtype=torch.float64,
                             device=self.device)
        return int(self.sum_over_ranks(local).item())

    def noise(self, step: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """N(0, σ²C²) like a parameter, from the generator of step ``step`` (the same on resume)."""
        generator = torch.Generator(device="cpu").manual_seed(self.privacy.cfg.seed * 1_000_003 + step)
        std = self.privacy.noise_multiplier * self.privacy.cfg.max_grad_norm
        return lambda p: (torch.randn(p.shape, generator=generator, dtype=torch.float32) * std).to(p)

    def clipped_sums(self, micro_batches: list) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Σ_i g_i · min(1, C/‖g_i‖) over this rank's rows, and (loss sum, targets, rows, rows clipped)."""
        trained = {n: p.detach() for n, p in self.model.named_parameters() if n in self.names}
        sums = {n: torch.zeros_like(p, dtype=accumulation_dtype(p)) for n, p in trained.items()}
        totals = torch.zeros(4, dtype=torch.float64)
        for micro in micro_batches:
            for rows in split_rows(example_rows(micro), self.chunk):
                counts = [self.objective.num_targets({k: v[i:i + 1] for k, v in rows.items()})
                          for i in range(len(rows["input_ids"]))]
                if not counts:
                    continue
                with autocast_context(self.device, self.precision):
                    grads, losses = per_example_gradients(self.model, self.objective, to_device(rows, self.device),
                                                          trained, torch.tensor(counts, device=self.device).clamp(min=1))
                factors, norms = clip_factors(grads, self.privacy.cfg.max_grad_norm)
                for name, g in grads.items():
                    sums[name] += torch.einsum("b,b...->...", factors.to(sums[name].dtype), g.to(sums[name].dtype))
                weights = torch.tensor(counts, dtype=torch.float64)
                totals += torch.stack([(losses.detach().double().cpu() * weights).sum(), weights.sum(),
                                       torch.tensor(float(len(counts)), dtype=torch.float64),
                                       (norms > self.privacy.cfg.max_grad_norm).sum().double().cpu()])
        return sums, totals

    def backward(self, micro_batches: list, first_gradient=None):
        sums, totals = self.clipped_sums(micro_batches)
        if self.parallel is None or self.parallel.dp_rank == 0:  # the noise once, on one rank
            draw = self.noise(self.privacy.steps)
            for name in self.names:
                sums[name] += draw(sums[name])
        flat = self.sum_over_ranks(torch.cat([sums[n].flatten() for n in self.names] + [totals.to(self.device)]))
        params = dict(self.model.named_parameters())
        offset = 0
        for name in self.names:
            p = params[name]
            p.grad = (flat[offset:offset + p.numel()].view_as(p) / self.privacy.expected_batch).to(p.dtype)
            offset += p.numel()
        loss_sum, n_targets, n_rows, clipped = flat[offset:].double().cpu().tolist()
        self.privacy.step()
        self.dp_metrics = {"dp/epsilon": torch.tensor(self.privacy.epsilon(), dtype=torch.float64),
                           "dp/batch_rows": torch.tensor(n_rows), "dp/clipped_fraction": torch.tensor(clipped / max(n_rows, 1))}
        return torch.tensor(loss_sum / max(n_targets, 1)), int(n_targets), {}, {}

    def clip_gradients(self) -> torch.Tensor:
        """The noised gradient's norm: each example's gradient was clipped in ``backward``."""
        return self.gradient_norm()

    def run_step(self, micro_batches: list, accept=None, measure_noise: bool = False) -> StepResult:
        if measure_noise:
            raise ConfigError("dp with train.noise_scale_every: the noise scale compares micro-batches' mean "
                              "gradients, which DP-SGD does not form; set train.noise_scale_every=0")
        if self.privacy.cfg.on_budget_exceeded == "stop" and self.privacy.over_budget():
            raise InputError(f"dp: this run has spent its privacy budget (ε = {self.privacy.epsilon():.4g} of "
                             f"dp.epsilon = {self.privacy.cfg.epsilon} after {self.privacy.steps} steps) and stopped "
                             "there; another step would spend more")
        result = super().run_step(micro_batches, accept)
        return result._replace(metrics={**result.metrics, **self.dp_metrics})
