"""The teacher of a distillation: checked against the student before any work, loaded, and (with
``distill.top_k``) its k largest logits per position computed once and stored in the run directory.

**Checks** (one line each, naming ``distill.teacher``, before the run directory is written): the
checkpoint exists; its tokenizer is the student's (same ``tokenizer.json``, so token i means the same
string to both) and its vocabulary size the student's (the two distributions are compared entry by
entry); its context holds the student's sequences.

**The top-k file.** ``teacher_topk.safetensors`` holds, for every training row, the teacher's k
largest logits and their token ids at every position, keyed by a hash of the row's tokens (and
positions, for packed rows): a row's teacher logits depend only on its content, so any loader order,
mixture or resume finds them by key. Its metadata names the teacher (the sha256 of its
``checksums.json``), k and a digest of the keys; a rerun or resume whose teacher, k and rows are the
same reads it instead of recomputing, and anything else recomputes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from lmforge.checkpoints.files import CHECKSUMS, load_model_config
from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.core.io import InputError, atomic_write_bytes, sha256_file
from lmforge.core.run import log
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.shards import read_manifest
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.transformer import Transformer
from lmforge.objectives.base import Objective
from lmforge.objectives.distill import DistillConfig, DistillObjective, live_teacher

TOPK_FILE = "teacher_topk.safetensors"
TOPK_FORMAT = "lmforge-teacher-topk"


def teacher_checkpoint(path: str, key: str = "distill.teacher") -> Path:
    """The teacher's checkpoint directory (verified); a missing or damaged one is an ``InputError`` naming ``key``."""
    try:
        return resolve_checkpoint(path)
    except InputError as exc:
        raise InputError(f"{key}: {exc}") from exc


def check_teacher(path: str, tokenizer_dir: str | Path, vocab_size: int, seq_len: int, top_k: int = 0,
                  key: str = "distill.teacher") -> Path:
    """The teacher's directory, once it is known to fit a student of ``vocab_size`` trained on ``tokenizer_dir``'s
    tokenizer at ``seq_len`` tokens (module docstring); from its config and tokenizer alone, no weights."""
    if top_k > vocab_size:
        raise InputError(f"distill.top_k {top_k} exceeds the vocabulary's {vocab_size} entries")
    directory = teacher_checkpoint(path, key)
    model = load_model_config(directory)
    theirs, ours = Tokenizer.load(directory).sha256, Tokenizer.load(tokenizer_dir).sha256
    if theirs != ours:
        raise InputError(f"{key}: {directory} was trained with another tokenizer than the student's ({tokenizer_dir}): "
                         "distillation compares the two models' next-token distributions token by token, so both "
                         "must use the same tokenizer")
    if model.vocab_size != vocab_size:
        raise InputError(f"{key}: {directory} has a vocabulary of {model.vocab_size} entries, the student {vocab_size}: "
                         "the two distributions must be over the same entries (set model.vocab_size as the teacher's)")
    if model.max_seq_len < seq_len:
        raise InputError(f"{key}: {directory} reads at most {model.max_seq_len} tokens, the student's rows are {seq_len}")
    return directory


def load_teacher(directory: Path, device: torch.device) -> Transformer:
    """The teacher, frozen and in evaluation mode."""
    model, _ = load_model(directory, device=device, verify=False)  # verified by check_teacher
    return model.eval().requires_grad_(False)


def teacher_identity(directory: Path) -> str:
    """What names a teacher's weights in the top-k file: the sha256 of its checksums (which cover the weights)."""
    checksums = directory / CHECKSUMS
    return sha256_file(checksums) if checksums.is_file() else str(directory.resolve())


# --------------------------------------------------------------------------- the top-k file


def row_keys(ids: torch.Tensor, kwargs: dict) -> list[int]:
    """A 63-bit hash of each row's tokens (and positions, which give a packed row's mask, when it has them)."""
    parts = [ids.detach().cpu().to(torch.int64).numpy()]
    if kwargs.get("positions") is not None:
        parts.append(kwargs["positions"].detach().cpu().to(torch.int64).numpy())
    keys = []
    for row in range(len(ids)):
        digest = hashlib.blake2b(b"".join(np.ascontiguousarray(p[row]).tobytes() for p in parts), digest_size=8)
        keys.append(int.from_bytes(digest.digest(), "little") >> 1)
    return keys


class TopKCache:
    """The stored top k of the teacher, looked up by row content: ``(ids, kwargs, at)`` -> (token ids (N, k), logits
    (N, k)) at ``at``'s N positions, in row-major order as the student's ``head_at`` logits."""

    def __init__(self, keys: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, where: Path):
        self.index = {int(k): i for i, k in enumerate(keys.tolist())}
        self.ids, self.logits, self.where = ids, logits, where

    def __call__(self, ids: torch.Tensor, kwargs: dict, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for key in row_keys(ids, kwargs):
            if key not in self.index:
                raise InputError(f"distill.top_k: a training row is not in {self.where}; delete it to recompute it")
            rows.append(self.index[key])
        mask = at.cpu()
        return self.ids[rows][mask].to(torch.long), self.logits[rows][mask]


def read_topk(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]] | None:
    """The metadata and tensors of a top-k file, or None when it is missing or unreadable (then recomputed)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {n: f.get_tensor(n) for n in f.keys()}
    except Exception:  # a truncated file is recomputed, never trusted
        return None


def topk_cache(path: Path, teacher: nn.Module, rows: Iterable[tuple[torch.Tensor, dict]], k: int, identity: str,
               autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> TopKCache:
    """The top-k file at ``path`` for ``rows`` ((input ids (B, T), model kwargs) batches, every row of one T):
    read when its teacher, k and rows are these, else computed by ``teacher`` under ``autocast`` and written."""
    batches = list(rows)
    keys = torch.tensor([key for ids, kwargs in batches for key in row_keys(ids, kwargs)], dtype=torch.int64)
    meta = {"format": TOPK_FORMAT, "teacher": identity, "top_k": str(k),
            "rows": hashlib.sha256(keys.numpy().tobytes()).hexdigest()}
    stored = read_topk(path)
    if stored is not None and all(stored[0].get(name) == value for name, value in meta.items()):
        log.info("distill: the teacher's top %d logits of %d rows read from %s", k, len(keys), path)
        tensors = stored[1]
        return TopKCache(tensors["keys"], tensors["ids"], tensors["logits"], path)
    began = time.perf_counter()
    device = next(teacher.parameters()).device
    top_ids, top_logits = [], []
    with torch.no_grad():
        for ids, kwargs in batches:
            with autocast():
                logits = teacher(ids.to(device), **{n: v.to(device) for n, v in kwargs.items() if v is not None})
            values, indices = logits.float().topk(k, dim=-1)
            top_ids.append(indices.to(torch.int32).cpu())
            top_logits.append(values.cpu())
    tensors = {"keys": keys, "ids": torch.cat(top_ids), "logits": torch.cat(top_logits)}
    atomic_write_bytes(path, save(tensors, metadata=meta))
    log.info("distill: the teacher's top %d logits of %d rows computed in %.1f s into %s", k, len(keys),
             time.perf_counter() - began, path)
    return TopKCache(tensors["keys"], tensors["ids"], tensors["logits"], path)


def check_replay(cfg: DistillConfig, tokenizer_dir: str | Path) -> None:
    """``distill.replay``'s shards exist, hold a window, were tokenized with the student's tokenizer, and go with a
    live teacher; before anything is written."""
    if not cfg.replay:
        return
    if cfg.top_k:
        raise InputError("distill.replay distils replayed windows with the live teacher, which distill.top_k replaces; "
                         "set distill.top_k=0 or remove distill.replay")
    ours = Tokenizer.load(tokenizer_dir).sha256
    for i, path in enumerate(cfg.replay):
        if read_manifest_sha(path, f"distill.replay[{i}]") != ours:
            raise InputError(f"distill.replay[{i}]: {path} was tokenized with another tokenizer than the student's")


def read_manifest_sha(path: str, key: str) -> str:
    """The tokenizer sha256 of prepared shards at ``path``; an ``InputError`` naming ``key`` when there are none."""
    try:
        return read_manifest(path)["tokenizer_sha256"]
    except InputError as exc:
        raise InputError(f"{key}: {exc}") from exc


def replay_windows(cfg: DistillConfig) -> TokenLoader | None:
    """The replayed windows of ``distill.replay`` (None without): an endless seeded stream over its shards, equally
    mixed, ``replay_windows`` of ``replay_seq_len`` + 1 tokens per draw."""
    if not cfg.replay:
        return None
    data = LoaderConfig(datasets=[DatasetSource(path) for path in cfg.replay], seq_len=cfg.replay_seq_len)
    return TokenLoader(data, cfg.replay_windows, split="train")


def teacher_objective(inner: Objective, cfg: DistillConfig | None, device: torch.device, run_dir: Path,
                      training_batches: Callable[[], Iterable]) -> Objective:
    """``inner`` mixed with the teacher's term (``inner`` itself without ``distill:``): ``cfg.teacher`` live, or
    with ``cfg.top_k`` its top k (in float32) over every batch of ``training_batches()`` (in ``inner``'s format),
    read from or written to ``run_dir/teacher_topk.safetensors``."""
    if cfg is None:
        return inner
    directory = teacher_checkpoint(cfg.teacher)
    teacher = load_teacher(directory, device)
    if cfg.top_k == 0:
        return DistillObjective(inner, cfg, teacher=live_teacher(teacher), replay=replay_windows(cfg))
    rows = ((ids, kwargs) for ids, kwargs, _ in map(inner.inputs, training_batches()))
    cache = topk_cache(run_dir / TOPK_FILE, teacher, rows, cfg.top_k, teacher_identity(directory))
    return DistillObjective(inner, cfg, topk=cache)
