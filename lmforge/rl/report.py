"""The lifecycle report's RL lines: the reward, the KL to the reference and the response length
against step (one figure of three panels), and where a step's time went (``time/<phase>_s``,
``train.step_log``), from the stage's ``metrics.jsonl`` and summary."""

from __future__ import annotations

from pathlib import Path

from lmforge.train.loggers import log_figures
from lmforge.train.metrics import read_metrics

# the KL figure of a panel: the reference's, estimated in the loss (GRPO with kl_coef > 0) or in the
# reward (PPO), else the approximate KL between the sampling policy and the updated one
KL_KEYS = ("kl_ref", "kl", "approx_kl")
# a step's phases in the order they run: drawing the rollout batch (with its parts), then the update
PHASES = ("rollout", "reward", "reference", "critic", "old_logprobs", "forward_backward", "optimizer")


def curve_lines(stage_dir: Path, out: Path) -> list[str]:
    """The report's figure of reward, KL and response length (into ``out``); none without records."""
    records = [r for r in read_metrics(stage_dir) if "reward_mean" in r]
    if not records:
        return []
    plot_curves(records, out)
    log_figures(stage_dir, [out], records[-1]["step"])  # to the W&B / MLflow runs train.loggers opened
    first, last = records[0], records[-1]
    kl = next((k for k in KL_KEYS if k in last), None)
    line = (f"- reward mean {first['reward_mean']:.3f} → {last['reward_mean']:.3f} (steps {first['step']} → "
            f"{last['step']}), response length {first['response_length_mean']:.1f} → "
            f"{last['response_length_mean']:.1f} tokens")
    if kl is not None:
        line += f", {kl} {first.get(kl, 0.0):.4f} → {last[kl]:.4f}"
    return [line, "", f"![reward, KL and response length]({out.name})", ""]


def plot_curves(records: list[dict], out: Path) -> Path:
    """Reward (mean ± std, and each reward term's mean), KL and response length (mean, max) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (reward, kl, length) = plt.subplots(1, 3, figsize=(13, 3.6))
    mean = [r["reward_mean"] for r in records]
    std = [r.get("reward_std", 0.0) for r in records]
    reward.plot(steps, mean, label="reward mean")
    reward.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                        label="± std")
    for key in sorted({k for r in records for k in r if k.startswith("score_")}):
        reward.plot(steps, [r.get(key, float("nan")) for r in records], "--", linewidth=1, label=key.removeprefix("score_"))
    reward.set_title("reward")
    for key in (k for k in KL_KEYS if any(k in r for r in records)):
        kl.plot(steps, [r.get(key, float("nan")) for r in records], label=key)
    kl.set_title("KL")
    length.plot(steps, [r["response_length_mean"] for r in records], label="mean")
    length.plot(steps, [r.get("response_length_max", float("nan")) for r in records], ":", label="max")
    length.set_title("response length (tokens)")
    for ax in (reward, kl, length):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def time_split(summary: dict) -> dict[str, float]:
    """The mean seconds of each phase of a step (after the first), from a training summary."""
    return {p: summary[f"time/{p}_s"] for p in PHASES if summary.get(f"time/{p}_s")}


def time_split_line(summary: dict) -> list[str]:
    """``- a step: rollout 2.1 s (40%), ...``; none when the summary has no split."""
    split = time_split(summary)
    total = sum(split.values())
    if not total:
        return []
    parts = ", ".join(f"{p.replace('_', ' ')} {s:.2f} s ({100 * s / total:.0f}%)" for p, s in split.items())
    return [f"- a step's time (mean over the steps after the first): {parts}"]
