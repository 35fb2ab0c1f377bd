"""Tokenize JSONL, Parquet and plain-text documents into token shards: per shard a flat
memory-mapped token array (uint16 when the vocabulary fits, else uint32) and a document
index, plus manifest.json (tokenizer hash, counts, sources, skipped records). Documents
go to train or validation by a stable hash of their id. Output is deterministic and
written atomically into run_dir.

  lmforge prepare recipes/demo/prepare.yaml val_fraction=0.01
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.core.config import positive, save_config, unit_interval
from lmforge.core.io import InputError, atomic_directory, atomic_write_json, expand_paths, remove_temporaries
from lmforge.core.run import log, progress_bar
from lmforge.data.documents import DocumentsConfig, SkipLog, read_documents
from lmforge.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, open_shards, token_dtype, tokenize_to_shards
from lmforge.data.tokenizer import Tokenizer


@dataclass
class PrepareRecipe:
    run_dir: str = "runs/data"  # the prepared dataset: shards, manifest.json, config.yaml, stats.json
    tokenizer: str = "runs/tokenizer"  # directory holding tokenizer.json
    data: DocumentsConfig = field(default_factory=DocumentsConfig)
    val_fraction: float = unit_interval(0.05, high_open=True)  # by a stable hash of the document id
    shard_tokens: int = positive(50_000_000)  # a shard is closed once it holds this many tokens
    add_bos: bool = True
    add_eos: bool = True
    batch_docs: int = positive(512)  # documents per parallel encode call

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1 or self.batch_docs < 1:
            raise ValueError("shard_tokens and batch_docs must be positive")


def run_prepare(recipe: PrepareRecipe) -> dict:
    tok = Tokenizer.load(recipe.tokenizer)
    total_bytes = sum(p.stat().st_size for p in expand_paths(recipe.data.paths, what="document"))
    skipped = SkipLog()
    t0 = time.perf_counter()
    out_dir = Path(recipe.run_dir)
    if removed := remove_temporaries(out_dir.parent, of=out_dir.name):  # a killed prepare's unfinished output
        log.info("removed %d temporary folders a killed prepare left: %s", len(removed), ", ".join(map(str, removed)))
    with atomic_directory(recipe.run_dir) as out:
        bar = progress_bar(total_bytes, "tokenizing", unit="B", unit_scale=True)
        result = tokenize_to_shards(
            read_documents(recipe.data, skipped),
            tok,
            out,
            val_fraction=recipe.val_fraction,
            shard_tokens=recipe.shard_tokens,
            add_bos=recipe.add_bos,
            add_eos=recipe.add_eos,
            batch_docs=recipe.batch_docs,
            progress=lambda docs, nbytes: bar.update(nbytes),
        )
        bar.close()
        seconds = time.perf_counter() - t0
        splits = result["splits"]
        n_docs = sum(s["n_docs"] for s in splits.values())
        if n_docs == 0:
            raise InputError(
                f"no documents found in {recipe.data.paths}: the input is empty"
                + (f" ({skipped.total} bad records skipped: {dict(skipped.by_reason)})" if skipped.total else "")
            )
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer_sha256": tok.sha256,
            "tokenizer": recipe.tokenizer,
            "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size).name,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "add_bos": recipe.add_bos,
            "add_eos": recipe.add_eos,
            "val_fraction": recipe.val_fraction,
            "n_tokens": sum(s["n_tokens"] for s in splits.values()),
            "n_docs": n_docs,
            "splits": splits,
            "sources": result["sources"],
            "skipped": skipped.to_dict(),
        }
        atomic_write_json(out / MANIFEST, manifest)
        save_config(recipe, out)
        n_tokens = manifest["n_tokens"]
        stats = {
            "seconds": round(seconds, 3),
            "tokens_per_second": round(n_tokens / seconds, 1),
            "megabytes_per_second": round(total_bytes / seconds / 1e6, 3),
            "input_bytes": total_bytes,
        }
        atomic_write_json(out / "stats.json", stats)
    log.info(
        "prepare: %d documents -> %d tokens (train %d, val %d) in %.1fs (%.0f tokens/s) -> %s",
        n_docs, n_tokens, splits["train"]["n_tokens"], splits["val"]["n_tokens"], seconds, n_tokens / seconds, recipe.run_dir,
    )
    warn_empty_splits(splits, recipe.val_fraction)
    if skipped.total:
        log.info("prepare: skipped %d bad records: %s (listed in manifest.json)", skipped.total, dict(skipped.by_reason))
    return manifest


def warn_empty_splits(splits: dict, val_fraction: float) -> None:
    """A split that received no document (few documents, a small ``val_fraction``) is worth a
    warning: pre-training on it would report no validation loss, or have nothing to train on."""
    n_docs = sum(s["n_docs"] for s in splits.values())
    if val_fraction > 0 and splits["val"]["n_docs"] == 0:
        log.warning("prepare: the validation split is empty: none of the %d documents hashed into val_fraction=%g; "
                    "pretrain will report no validation loss (raise val_fraction or add documents)", n_docs, val_fraction)
    if splits["train"]["n_docs"] == 0:
        log.warning("prepare: the train split is empty: all %d documents hashed into the validation split "
                    "(val_fraction=%g); lower val_fraction or add documents", n_docs, val_fraction)


def verify_outputs(recipe: PrepareRecipe) -> None:
    """Hash every shard in ``run_dir`` against its manifest (an ``InputError`` names the first that
    differs): what the lifecycle runner checks before reusing a completed prepare."""
    for split in SPLITS:
        open_shards(recipe.run_dir, split, verify=True)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report."""
    s = res.get("splits", {})
    return [f"- {res.get('n_docs')} documents, {res.get('n_tokens')} tokens ({res.get('dtype')}): "
            f"train {s.get('train', {}).get('n_tokens')} / val {s.get('val', {}).get('n_tokens')} tokens",
            f"- skipped records: {res.get('skipped', {}).get('total', 0)}"]


RECIPE = PrepareRecipe
run = run_prepare
