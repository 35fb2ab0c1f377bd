"""Distillation: a teacher's distribution over the next token as the student's target, offline
(Hinton et al. 2015, on the stage's own data) and on-policy (GKD, Agarwal et al. 2024, on the
student's own samples).

**Offline (``distill:`` in ``pretrain`` and ``sft``).** The stage's data loss mixed with the KL from
the teacher's softened distribution to the student's, at every target token t:

    p_T = softmax(z_T / τ),  p_S = softmax(z_S / τ)
    L = (1 − α) · L_data + α · τ² · Σ_t KL(p_T(·|x_<t) ‖ p_S(·|x_<t))           (Hinton et al. 2015, §2)

τ² keeps the soft term's gradients on the scale of the hard one's as τ grows (Hinton's §2.1). With
``top_k`` the teacher's k largest logits at each position are computed once and stored in the run
directory (``objectives.distill_teacher``); the loss is then the KL between the two distributions
restricted to those k tokens and renormalised over them (``topk_kd_loss``), which equals the full KL
when k is the vocabulary. Evaluation scores the stage's own loss alone, so validation stays
comparable with a run without a teacher.

**On-policy (``lmforge distill``).** The student samples responses through the inference engine and
the teacher scores every token of them; the loss is the generalised Jensen-Shannon divergence per
response token (``generalized_jsd``, TRL's ``GKDTrainer.generalized_jsd_loss``): β = 1 the reverse KL
KL(p_S ‖ p_T) (the default: mode-seeking, GKD's on-policy choice), β = 0 the forward KL.

Every loss here returns a sum over positions; the loop divides by the step's target count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import at_least, option, positive, unit_interval
from lmforge.data.packing import IGNORE_INDEX
from lmforge.model.reward import model_inputs
from lmforge.objectives.base import LossOutput, Objective


@dataclass
class DistillConfig:
    """The ``distill:`` section of ``pretrain`` and ``sft``: offline knowledge distillation."""

    teacher: str = option(help="the teacher: any lmforge checkpoint or run directory whose tokenizer and vocabulary "
                          "are the student's (its size may differ); the pre-trained model itself for self-distillation")
    temperature: float = positive(2.0, help="τ of softmax(z / τ) for both models; the KL term is scaled by τ²")
    alpha: float = unit_interval(0.5, help="α: the loss is (1 − α)·data loss + α·τ²·KL(teacher ‖ student) per target")
    top_k: int = at_least(0, 0, help="0: the teacher's full logits, computed live each step; k > 0: its k largest "
                          "logits per position computed once and stored in run_dir/teacher_topk.safetensors, the KL "
                          "over those k tokens renormalised")
    replay: list[str] = option(default_factory=list, help="sft: token shards (`lmforge prepare`'s, the pre-training "
                               "data) whose windows the live teacher also distils each training micro-batch: "
                               "self-distillation on replayed pre-training text")
    replay_windows: int = positive(4, help="replayed windows per training micro-batch")
    replay_seq_len: int = positive(128, help="tokens per replayed window")
    replay_weight: float = at_least(0.0, 1.0, help="w of the loss's + w·τ²·KL per replayed token (each micro-batch's "
                                    "replay term weighted by its share of the step's targets)")


# --------------------------------------------------------------------------- the losses


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """τ² · Σ_n KL(softmax(z_T,n / τ) ‖ softmax(z_S,n / τ)) over the N positions of (N, V) logits, in float32

        τ² · Σ_n Σ_v p_T,nv (log p_T,nv − log p_S,nv)                                  (Hinton et al. 2015)
    """
    log_s = F.log_softmax(student_logits.float() / temperature, -1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, -1)
    return temperature**2 * F.kl_div(log_s, log_t, reduction="sum", log_target=True)


def topk_kd_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logits: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """The KD loss over the teacher's top k tokens S_n at each position, both distributions renormalised on S_n:

        p̂_T,ni = exp(z_T,ni / τ) / Σ_{j∈S_n} exp(z_T,nj / τ),  p̂_S,ni likewise from the student's logits
        L = τ² · Σ_n Σ_{i∈S_n} p̂_T,ni (log p̂_T,ni − log p̂_S,ni)

    ``student_logits`` (N, V); ``teacher_ids`` (N, k) the tokens S_n and ``teacher_logits`` (N, k) the teacher's
    logits of them. This is the KL between the two models' distributions given that the next token is in S_n: the
    probability mass outside S_n is dropped from both, so it is zero when the student matches the teacher on S_n
    whatever it does elsewhere, and equals ``kd_loss`` when k = V."""
    picked = student_logits.float().gather(-1, teacher_ids.long())
    return kd_loss(picked, teacher_logits, temperature)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence per position (N,) of (N, V) logits, in float32, as TRL's
    ``GKDTrainer.generalized_jsd_loss`` computes it (Agarwal et al. 2024, eq. 1), with P_T = softmax(z_T / τ),
    P_S = softmax(z_S / τ) and the mixture M = β P_T + (1 − β) P_S:

        JSD_β = β · KL(P_T ‖ M) + (1 − β) · KL(P_S ‖ M)        for 0 < β < 1
        β = 0: KL(P_T ‖ P_S) (forward KL);  β = 1: KL(P_S ‖ P_T) (reverse KL)

    (The endpoints are TRL's special cases: JSD_β itself tends to 0 at both ends; no τ² factor, as in TRL.)"""
    log_s = F.log_softmax(student_logits.float() / temperature, -1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, -1)
    if beta == 0:
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=log_s.dtype, device=log_s.device)
    log_m = torch.logsumexp(torch.stack([log_s + torch.log1p(-b), log_t + torch.log(b)]), 0)
    kl_t = F.kl_div(log_m, log_t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(log_m, log_s, reduction="none", log_target=True).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_S ‖ p_T) per position (N,) at temperature 1: what on-policy distillation drives down."""
    return generalized_jsd(student_logits, teacher_logits, beta=1.0)


# --------------------------------------------------------------------------- offline distillation

# (input_ids, head_at, model kwargs) -> the teacher's logits (N, V) at head_at's N positions
TeacherLogits = Callable[..., torch.Tensor]
# (input_ids, model kwargs, head_at) -> the cached (ids (N, k), logits (N, k)) at head_at's N positions
TopKLookup = Callable[[torch.Tensor, dict, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def live_teacher(teacher: nn.Module) -> TeacherLogits:
    """The teacher's logits at the marked positions, without gradient and in evaluation mode."""
    teacher.eval().requires_grad_(False)

    def logits(ids: torch.Tensor, head_at: torch.Tensor, kwargs: dict) -> torch.Tensor:
        with torch.no_grad():
            return teacher(ids, head_at=head_at, **kwargs)

    return logits


def target_positions(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) boolean over ``ids``: the positions whose logits predict a target (``targets`` (B, T') aligned
    with the first T' positions, T' ≤ T; ``IGNORE_INDEX`` is no target)."""
    at = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    at[:, : targets.shape[1]] = targets != IGNORE_INDEX
    return at


class DistillObjective(Objective):
    """``inner``'s data loss mixed with the KD term (module docstring) from one forward of the student.

    ``inner`` is a causal-LM objective with ``inputs(batch) -> (input_ids, model kwargs, targets)``
    (``CausalLMObjective``, ``SFTObjective``): the student's logits at the target positions give both the
    cross-entropy and the KL. The teacher is ``teacher`` (live logits) or ``topk`` (the stored top k).
    Logged: ``distill/kd`` (τ²·KL) and ``distill/data_loss``, means per target.

    With ``replay`` (an iterator of token windows (R, L + 1) with ``state_dict``, the live teacher's) each
    training micro-batch m of n_m targets also distils R·L replayed tokens, adding

        w · (n_m / (R·L)) · τ² · Σ_replayed KL(p_T ‖ p_S)

    to its sum: the step's loss is the data's mixture plus w times the target-weighted mean of each
    micro-batch's replayed KL per token (logged as ``distill/replay_kd``). The replay's position is the
    objective's state, saved with the checkpoint, so a run resumes on the same windows."""

    def __init__(self, inner: Objective, cfg: DistillConfig, teacher: TeacherLogits | None = None,
                 topk: TopKLookup | None = None, replay: Any = None):
        if (teacher is None) == (topk is None):
            raise ValueError("give a live teacher or a top-k cache, one of the two")
        if replay is not None and teacher is None:
            raise ValueError("replayed windows need the live teacher")
        self.inner, self.cfg, self.teacher, self.topk, self.replay = inner, cfg, teacher, topk, replay

    def state_dict(self) -> dict | None:
        if self.replay is None:
            return self.inner.state_dict()
        return {"replay": self.replay.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        if self.replay is None:
            return self.inner.load_state_dict(state)
        if state is None or "replay" not in state:
            raise ValueError("distill.replay: the checkpoint holds no position in the replayed windows (it was "
                             "written without distill.replay); resume it as it was, or use a new run_dir")
        self.replay.load_state_dict(state["replay"])
        self.inner.load_state_dict(state.get("inner"))

    @property
    def static_shapes(self) -> bool:  # type: ignore[override]
        return self.inner.static_shapes

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        self.inner.static_shapes = value

    def num_targets(self, batch: Any) -> int:
        return self.inner.num_targets(batch)

    def num_tokens(self, batch: Any) -> int:
        return self.inner.num_tokens(batch)

    def __call__(self, model: nn.Module, batch: Any) -> LossOutput:
        if not torch.is_grad_enabled():  # validation: the stage's own loss
            return self.inner(model, batch)
        ids, kwargs, targets = self.inner.inputs(batch)
        at = target_positions(ids, targets)
        logits = model(ids, head_at=at, **kwargs)
        data = F.cross_entropy(logits.float(), targets[at[:, : targets.shape[1]]], reduction="sum")
        tau = self.cfg.temperature
        if self.topk is not None:
            top_ids, top_logits = self.topk(ids, kwargs, at)
            kd = topk_kd_loss(logits, top_ids.to(logits.device), top_logits.to(logits.device), tau)
        else:
            kd = kd_loss(logits, self.teacher(ids, at, kwargs), tau)
        alpha = self.cfg.alpha
        loss = (1 - alpha) * data + alpha * kd
        n_targets = self.inner.num_targets(batch)
        metrics = {"distill/kd": kd.detach(), "distill/data_loss": data.detach()}
        if self.replay is not None:
            windows = next(self.replay).to(ids.device)
            inputs = windows[:, :-1]
            everywhere = torch.ones(inputs.shape, dtype=torch.bool, device=ids.device)
            replayed = kd_loss(model(inputs, head_at=everywhere), self.teacher(inputs, everywhere, {}), tau)
            term = replayed * (n_targets / inputs.numel())
            loss = loss + self.cfg.replay_weight * term
            metrics["distill/replay_kd"] = term.detach()
        return LossOutput(loss, n_targets, metrics=metrics)


def distill_objective(inner: Objective, cfg: DistillConfig | None, teacher: TeacherLogits | None = None,
                      topk: TopKLookup | None = None) -> Objective:
    """``inner`` with ``cfg``'s teacher term (``inner`` itself without ``distill:``)."""
    if cfg is None:
        return inner
    return DistillObjective(inner, cfg, teacher, topk)


# --------------------------------------------------------------------------- on-policy distillation


@dataclass
class GKDConfig:
    """The ``objective:`` section of ``lmforge distill``: the divergence per sampled token."""

    beta: float = unit_interval(1.0, help="β of the generalised JSD in TRL's convention: 1 reverse KL KL(student ‖ "
                                "teacher), 0 forward KL KL(teacher ‖ student), between them the JSD of the mixture")
    temperature: float = positive(1.0, help="τ of softmax(z / τ) for both models in the divergence (TRL's "
                                  "temperature; no τ² factor)")


class OnPolicyDistillObjective(Objective):
    """GKD on rollouts: Σ over the response tokens of ``generalized_jsd``(student, teacher), a token mean over
    the step (Agarwal et al. 2024, Algorithm 1 with λ = 1: every batch the student's own samples).

    A micro-batch is a rollout batch's (``rl.trainer.RolloutBatches``): ``input_ids``, ``attention_mask`` and the
    ``loss_mask`` of the response tokens; each model's logits are computed only at the positions that predict
    them. Logged as means per response token: ``reverse_kl`` and ``forward_kl`` at τ = 1 (what the run is meant
    to drive down) and ``teacher_logprob``, the teacher's log-probability of the student's token; and the rollout
    batch's own figures, its columns named ``stat_prefix`` + name (one value repeated per row), as they are (those
    in ``stat_maxima`` as maxima)."""

    def __init__(self, cfg: GKDConfig, teacher: TeacherLogits, stat_prefix: str = "stat_",
                 stat_maxima: tuple[str, ...] = ()):
        self.cfg, self.teacher, self.stat_prefix, self.stat_maxima = cfg, teacher, stat_prefix, stat_maxima

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["loss_mask"].sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        ids = batch["input_ids"]
        at = batch["loss_mask"].bool()
        head_at = torch.zeros_like(at)
        head_at[:, :-1] = at[:, 1:]  # position t's logits predict token t + 1
        kwargs = model_inputs(ids, batch.get("attention_mask"))
        student = model(ids, head_at=head_at, **kwargs)
        teacher = self.teacher(ids, head_at, kwargs)
        loss = generalized_jsd(student, teacher, self.cfg.beta, self.cfg.temperature).sum()
        with torch.no_grad():
            tokens = ids[:, 1:][at[:, 1:]]
            metrics = {"reverse_kl": reverse_kl(student, teacher).sum(),
                       "forward_kl": generalized_jsd(student, teacher, 0.0).sum(),
                       "teacher_logprob": F.log_softmax(teacher.float(), -1).gather(-1, tokens[:, None]).sum()}
        n_targets, maxima = self.num_targets(batch), {}
        for key, column in batch.items():
            if key.startswith(self.stat_prefix):
                name = key[len(self.stat_prefix):]
                if name in self.stat_maxima:
                    maxima[name] = column[0].float()
                else:  # a sum over the step's targets, whose mean the loop logs: the figure itself
                    metrics[name] = column[0].float() * n_targets
        return LossOutput(loss, n_targets, metrics=metrics, maxima=maxima)

