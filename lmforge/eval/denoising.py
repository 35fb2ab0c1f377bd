"""Text scored for a checkpoint pre-trained with a denoising objective (``lmforge pretrain
objective=mlm|span``): masked-token accuracy and loss for masked LM, span-reconstruction loss and
accuracy for span corruption, in place of the causal bits per byte such a model cannot give.

A text task's documents (each BOS, its tokens, EOS, as ``lmforge prepare`` stores them) are laid
end to end and cut into windows of the training's ``data.seq_len + 1`` tokens (a last partial
window is left out); each window is corrupted as training corrupted it (the checkpoint's
``mlm.*`` or ``span.*`` keys in its ``config.yaml``), the draws keyed by ``seed`` and the
window's index, so the same text, seed and checkpoint give the same figures. The loss and
accuracy are means over the targets (the selected tokens; the spans and their sentinels), their
stderr that of a mean of independent targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import ConfigError, from_dict
from lmforge.core.io import InputError
from lmforge.core.run import CONFIG_FILE
from lmforge.core.untrusted import load_yaml
from lmforge.data.noising import MaskingConfig, Noise, SpanConfig, build_noise, noise_batch
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.evaluate import EvalSettings, MetricResult, target_text
from lmforge.eval.metrics import mean_stderr
from lmforge.eval.tasks import Task, limited
from lmforge.objectives.denoising import prefix_lm_mask

SCORED = {"mlm": "masked", "span": "span"}  # the objectives scored here, and their figures' prefix


@dataclass
class TrainedDenoising:
    """How a checkpoint was pre-trained: its objective, the corruption and the window length."""

    objective: str
    noise: Noise
    seq_len: int
    settings: dict  # the objective's keys, for the figures' config hash


def trained_denoising(directory: Path, tok: Tokenizer, max_seq_len: int) -> TrainedDenoising | None:
    """The denoising objective the checkpoint at ``directory`` was pre-trained with, from its
    ``config.yaml``; None for any other (the causal LM, a prefix LM, an imported model)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    recipe = load_yaml(path.read_text(encoding="utf-8"), path)
    objective = recipe.get("objective", "clm") if isinstance(recipe, dict) else "clm"
    if objective not in SCORED:
        return None
    try:
        section = MaskingConfig if objective == "mlm" else SpanConfig
        keys = from_dict(section, recipe.get(objective) or {}, source=str(path), prefix=f"{objective}.")
    except ConfigError as exc:
        raise InputError(str(exc)) from exc
    seq_len = min(int((recipe.get("data") or {}).get("seq_len", max_seq_len)), max_seq_len)
    mlm, span = (keys, SpanConfig()) if objective == "mlm" else (MaskingConfig(), keys)
    noise = build_noise(objective, mlm, span, tok, seq_len, str(directory))
    return TrainedDenoising(objective, noise, seq_len, {"objective": objective, **asdict(keys), "seq_len": seq_len})


def text_windows(tok: Tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows of the documents laid end to end, each document BOS, tokens, EOS."""
    stream = [t for text in texts for t in [tok.bos_id, *tok.encode(text), tok.eos_id]]
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


@torch.inference_mode()
def target_scores(model: nn.Module, windows: torch.Tensor, noise: Noise, seed: int,
                  batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target of the corrupted ``windows``: its negative log-likelihood and whether the argmax is it."""
    device = model.embed.weight.device
    nll, correct = [], []
    for start in range(0, len(windows), batch_size):
        batch = noise_batch(windows[start : start + batch_size], noise, seed, 0, start)
        tokens, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        logits = model(tokens, attn_mask=prefix_lm_mask(batch["prefix_len"].to(device), tokens.shape[1]))
        scored = labels != IGNORE_INDEX
        picked, target = logits[scored].float(), labels[scored]
        nll.append(F.cross_entropy(picked, target, reduction="none").cpu())
        correct.append((picked.argmax(dim=-1) == target).float().cpu())
    return torch.cat(nll), torch.cat(correct)


def evaluate_denoising(task: Task, model: nn.Module, tok: Tokenizer, trained: TrainedDenoising,
                       settings: EvalSettings) -> list[MetricResult]:
    """``<prefix>_accuracy`` and ``<prefix>_loss`` (nats per target) of a text task's documents."""
    texts = [target_text(task, doc) for doc in limited(task.splits[task.eval_split()], settings.limit)]
    windows = text_windows(tok, texts, trained.seq_len)
    if len(windows) == 0:
        raise InputError(f"{task.path}: its documents are shorter than one window of {trained.seq_len + 1} tokens "
                         f"(the checkpoint's data.seq_len + 1), which objective={trained.objective} is scored on")
    nll, correct = target_scores(model, windows, trained.noise, settings.seed, settings.batch_size)
    if len(nll) == 0:
        raise InputError(f"{task.path}: no token of its {len(windows)} windows was selected for prediction")
    digest = task.config_hash({**settings.for_hash(0), **trained.settings})
    prefix = SCORED[trained.objective]

    def figure(metric: str, items: np.ndarray, higher_is_better: bool) -> MetricResult:
        err = mean_stderr(items.tolist()) if len(items) > 1 and settings.bootstrap_iters > 0 else None
        return MetricResult(task.name, f"{prefix}_{metric}", "none", float(items.mean()), err, len(items),
                            higher_is_better, "mean", 0, digest, str(task.path))

    return [figure("accuracy", correct.numpy(), True), figure("loss", nll.numpy(), False)]


def check_tasks(tasks: list[Task], trained: TrainedDenoising | None) -> None:
    """A masked LM scores text only: its bidirectional model gives no causal likelihood or generation."""
    if trained is None or trained.objective != "mlm":
        return
    other = [t for t in tasks if t.output_type != "loglikelihood_rolling"]
    if other:
        raise InputError(f"{other[0].path}: a {other[0].output_type} task scores a causal model, but the checkpoint "
                         "was pre-trained with objective=mlm; give it text (a JSONL, Parquet or text file, or prepared "
                         "data) for masked-token accuracy")
