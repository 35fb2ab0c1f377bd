"""Model checkpoints on disk: safetensors weights, the model config, the tokenizer, checksums.

A checkpoint is a directory::

    model.safetensors       weights (a tied output matrix is stored once, as embed.weight)
    model.json              ModelConfig
    (or, written by a distributed run, .metadata + __<rank>_0.distcp shards in place of
    model.safetensors: read by ``lmforge.distributed.checkpoint``)
    tokenizer.json, tokenizer_config.json
    checksums.json          sha256 of every other file, written last
    (training checkpoints add optimizer.pt, trainer_state.json, config.yaml)

Directories are written under a temporary name and renamed, so a checkpoint either
exists whole or not at all; ``checksums.json`` catches later truncation or corruption
(not tampering: whoever edits a file can rewrite it too, so nothing read is ever unpickled).
Weights holding NaN or inf are refused on loading, so a run that diverged is never resumed
or served from its poisoned state.

This module reads and writes one checkpoint directory of the single-file kind; finding a
run's checkpoints and reading either kind is ``lmforge.checkpoints.load``'s (``load_model``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmforge.core.io import InputError, atomic_write_json, file_stamps, reading, sha256_file
from lmforge.model import families
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer, rope_tables

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model.json"
CHECKSUMS = "checksums.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _transformer_and_prefix(model: torch.nn.Module) -> tuple[Transformer, str]:
    """The transformer inside ``model`` (itself, or a wrapper's ``backbone``, e.g. a reward model)."""
    return (model, "") if isinstance(model, Transformer) else (model.backbone, "backbone.")


def model_state_for_saving(model: Transformer) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    core, prefix = _transformer_and_prefix(model)
    if core.cfg.tie_embeddings:
        state.pop(prefix + "lm_head.weight", None)
    return state


def write_model_files(directory: Path, model: Transformer, tokenizer_dir: str | Path | None) -> None:
    """Weights, model config and tokenizer into ``directory`` (no checksums yet)."""
    save_file({k: v.cpu() for k, v in model_state_for_saving(model).items()}, str(directory / WEIGHTS), metadata={"format": "pt"})
    write_model_config(directory, model.cfg, tokenizer_dir)


def write_model_config(directory: Path, cfg: ModelConfig, tokenizer_dir: str | Path | None) -> None:
    """The model config and the tokenizer files into ``directory``."""
    atomic_write_json(directory / MODEL_CONFIG, dataclasses.asdict(cfg))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if not src.is_file():
                raise InputError(f"{src}: not found; cannot copy the tokenizer into the checkpoint")
            shutil.copyfile(src, directory / name)


def write_checksums(directory: Path) -> None:
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS)
    atomic_write_json(directory / CHECKSUMS, {name: sha256_file(directory / name) for name in files})


# What this process has verified: checkpoint directory -> (its checksums, each file's identity
# then, ``file_stamps(identity=True)``). Resume, the precision choice and loading each verify,
# and hashing a large checkpoint takes seconds; a file changed since, or different checksums,
# verifies anew.
_verified: dict[Path, tuple[dict[str, str], list]] = {}


def verify_checksums(directory: str | Path) -> None:
    """Check every file against ``checksums.json``; an ``InputError`` names the first that fails."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    if not path.is_file():
        raise InputError(f"{directory}: incomplete checkpoint (no {CHECKSUMS})")
    try:
        checksums = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable ({exc}); the checkpoint is truncated or corrupted") from exc
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise InputError(f"{path}: not a mapping of file name to sha256; the checkpoint is corrupted")
    key, stamps = directory.resolve(), file_stamps([directory], identity=True)
    if _verified.get(key) == (checksums, stamps):
        return
    for name, digest in checksums.items():
        f = directory / name
        if Path(name).is_absolute() or not f.resolve().is_relative_to(key):
            raise InputError(f"{path}: names {name!r}, a file outside the checkpoint; the checkpoint is corrupted")
        if not f.is_file():
            raise InputError(f"{path}: lists {name!r}, which is not in {directory}; the checkpoint is incomplete or "
                             f"corrupted")
        if sha256_file(f) != digest:
            raise InputError(f"{f}: checksum mismatch; the checkpoint is truncated or corrupted")
    if file_stamps([directory], identity=True) == stamps:  # nothing changed while hashing
        _verified[key] = (checksums, stamps)


# Checkpoint directory -> its files' identities when its weights were last found finite.
_finite: dict[Path, list] = {}


def nonfinite_weights(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf (one host sync)."""
    named = [(k, v) for k, v in named if v.is_floating_point()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(v).all().to(named[0][1].device) for _, v in named]).tolist()
    return [k for (k, _), ok in zip(named, finite) if not ok]


def check_finite_weights(directory: str | Path, tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Refuse a checkpoint whose weights hold NaN or inf (a run that diverged); an ``InputError``
    names the tensors. They are read one at a time from ``model.safetensors``, or taken from
    ``tensors`` (a lazy stream of a distributed checkpoint's, not read if the check is cached)."""
    directory = Path(directory)
    key, stamps = directory.resolve(), file_stamps([directory], identity=True)
    if _finite.get(key) == stamps:
        return
    if tensors is None:
        with reading(directory / WEIGHTS), safe_open(str(directory / WEIGHTS), framework="pt") as f:
            bad = [k for k in f.keys() if nonfinite_weights([(k, f.get_tensor(k))])]
    else:
        bad = [k for k, v in tensors if nonfinite_weights([(k, v)])]
    if bad:
        raise InputError(_nonfinite_message(str(directory), bad))
    _finite[key] = stamps


def check_finite_state(directory: str | Path, state: dict[str, torch.Tensor]) -> None:
    """``check_finite_weights`` of the weights already read from ``directory`` (one host sync),
    unless its files are unchanged since they last passed."""
    directory = Path(directory)
    key, stamps = directory.resolve(), file_stamps([directory], identity=True)
    if _finite.get(key) != stamps:
        if bad := nonfinite_weights(state.items()):
            raise InputError(_nonfinite_message(str(directory), bad))
        _finite[key] = stamps


def _nonfinite_message(where: str, bad: list[str]) -> str:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"{where}: weights hold non-finite values (NaN or inf) in {', '.join(bad[:3])}{more}: the run diverged "
            "before this checkpoint; use an earlier one")


def load_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / MODEL_CONFIG
    if not path.is_file():
        raise InputError(f"{path}: not found; not an lmforge checkpoint")
    with reading(path):
        data = json.loads(path.read_text())
        data.pop("preset", None)  # the saved fields are already resolved
        return families.model_config(data)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str,
                device: str | torch.device = "cpu") -> Transformer:
    """The model of ``cfg`` holding the weights ``state`` (read from the checkpoint ``where``)."""
    with torch.device("meta"):
        model = families.build(cfg)
    model.to_empty(device=device)
    load_weights(model, state, where=where)
    return model


def read_weights(directory: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's ``model.safetensors`` by parameter name. Weights holding NaN or inf are an
    ``InputError`` (a diverged run's: nothing to generate or export from)."""
    path = Path(directory) / WEIGHTS
    try:
        state = load_file(str(path), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise InputError(f"{path}: cannot read weights: {exc}") from exc
    check_finite_state(directory, state)
    return state


def load_weights(model: Transformer, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a saved state dict, re-tying the output matrix and rebuilding the RoPE tables."""
    core, prefix = _transformer_and_prefix(model)
    output_key = prefix + "lm_head.weight"
    if core.cfg.tie_embeddings:
        state = {k: v for k, v in state.items() if k != output_key}
    own = model.state_dict()
    mismatched = [f"{k} {tuple(v.shape)} (the model has {tuple(own[k].shape)})"
                  for k, v in state.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        raise InputError(f"{where}: weights do not match the model config: {', '.join(mismatched[:3])}"
                         + (f" and {len(mismatched) - 3} more" if len(mismatched) > 3 else ""))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {output_key} if core.cfg.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise InputError(f"{where}: weights do not match the model config (missing {missing}, unexpected {unexpected})")
    if core.cfg.tie_embeddings:
        core.lm_head.weight = core.embed.weight
    with torch.no_grad():
        cos, sin = rope_tables(core.cfg, core.rope_cos.device)
        core.rope_cos.copy_(cos)
        core.rope_sin.copy_(sin)
