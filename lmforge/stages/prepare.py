"""Tokenize JSONL, Parquet and plain-text documents into token shards: per shard a flat
memory-mapped token array (uint16 when the vocabulary fits, else uint32) and a document
index, plus manifest.json (tokenizer hash, counts, sources, split rule, skipped records).
Documents go to train or validation by a stable hash of their id (``split: hash``), by each
source file's own share (``source_hash``, ``source_tail``: the last part of each file, as
nanoGPT holds out a text's last 10%), or, with ``val_paths``, validation is the files named
there, as they are (see ``lmforge.data.split``). Output is deterministic and written
atomically into run_dir.

  lmforge prepare recipes/demo/prepare.yaml val_fraction=0.01
  lmforge prepare recipes/demo/prepare.yaml split=source_tail val_fraction=0.1
  lmforge prepare recipes/demo/prepare.yaml "val_paths=[heldout.jsonl]"
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.core.config import option, positive, save_config, unit_interval
from lmforge.core.io import InputError, atomic_write_json, expand_paths, remove_temporaries
from lmforge.core.run import atomic_run_dir, log, progress_bar, run_dir_lock
from lmforge.data.documents import DocumentsConfig, SkipLog
from lmforge.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, open_shards, token_dtype, tokenize_to_shards
from lmforge.data.split import SPLIT_RULES, SplitRule, files_split, source_split, validation_files
from lmforge.data.tokenizer import Tokenizer


@dataclass
class PrepareRecipe:
    run_dir: str = option("runs/data", help="the prepared dataset: shards, manifest.json, config.yaml, stats.json")
    tokenizer: str = option("runs/tokenizer", help="directory holding tokenizer.json")
    data: DocumentsConfig = field(default_factory=DocumentsConfig)
    val_fraction: float = unit_interval(
        0.05, high_open=True, help="the share of data.paths that goes to val, by `split`"
    )
    split: SplitRule = option(
        "hash", help="hash: by document id over all files | source_hash, source_tail: per file (data/split.py)"
    )
    val_paths: list[str] = option(
        default_factory=list, help="files/globs that are the val split, as read; data.paths all train"
    )
    shard_tokens: int = positive(50_000_000, help="a shard is closed once it holds this many tokens")
    add_bos: bool = option(True, help="begin each document with the tokenizer's bos token")
    add_eos: bool = option(True, help="end each document with the tokenizer's eos token")
    batch_docs: int = positive(512, help="documents per parallel encode call")

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.split not in SPLIT_RULES:
            raise ValueError(f"split must be one of {', '.join(SPLIT_RULES)}, got {self.split!r}")
        if self.split != "hash" and not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1) for split={self.split} (each source gives val its share), "
                             f"got {self.val_fraction}")
        if self.val_paths and self.split != "hash":
            raise ValueError(f"val_paths and split={self.split} cannot be combined: with val_paths the validation "
                             "split is those files and every document of data.paths trains; drop one of them")
        if self.shard_tokens < 1 or self.batch_docs < 1:
            raise ValueError("shard_tokens and batch_docs must be positive")


def split_record(recipe: PrepareRecipe) -> dict:
    """How the split was made, for the manifest: the rule and its fraction, or the validation files."""
    if recipe.val_paths:
        return {"rule": "files", "val_paths": recipe.val_paths}
    return {"rule": recipe.split, "val_fraction": recipe.val_fraction}


def run_prepare(recipe: PrepareRecipe) -> dict:
    """Before any work, ``run_dir`` is checked (a file or a link there is the user's: refused, never
    swapped aside, since prepare replaces its run_dir whole) and locked."""
    if Path(recipe.run_dir).is_symlink():
        raise InputError(f"run_dir = {recipe.run_dir}: is a link; prepare replaces its run_dir whole, so give the "
                         f"folder it points to ({Path(recipe.run_dir).resolve()}) or a new one")
    with run_dir_lock(recipe.run_dir):  # refuses an existing file; a second prepare into it fails at once
        return write_prepared(recipe)


def write_prepared(recipe: PrepareRecipe) -> dict:
    """``run_prepare`` in its locked run directory."""
    tok = Tokenizer.load(recipe.tokenizer)
    val_files = validation_files(recipe.val_paths, recipe.data.paths) if recipe.val_paths else []
    if val_files:
        log.info("prepare: the validation split is %d file(s) of val_paths, as read; every document of data.paths "
                 "trains (val_fraction does not apply)", len(val_files))
    total_bytes = sum(p.stat().st_size for p in [*val_files, *expand_paths(recipe.data.paths, what="document")])
    skipped = SkipLog()
    labelled = (files_split(recipe.data, val_files, skipped) if val_files
                else source_split(recipe.data, recipe.split, recipe.val_fraction, skipped))
    t0 = time.perf_counter()
    out_dir = Path(recipe.run_dir)
    if removed := remove_temporaries(out_dir.parent, of=out_dir.name):  # a killed prepare's unfinished output
        log.info("removed %d temporary folders a killed prepare left: %s", len(removed), ", ".join(map(str, removed)))
    with atomic_run_dir(recipe.run_dir) as out:
        bar = progress_bar(total_bytes, "tokenizing", unit="B", unit_scale=True)
        result = tokenize_to_shards(
            labelled,
            tok,
            out,
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
            "score_field": recipe.data.score_field,
            "val_fraction": None if val_files else recipe.val_fraction,
            "split": split_record(recipe),
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
    warn_empty_splits(splits, recipe.val_fraction, manifest["split"]["rule"], manifest["sources"])
    if skipped.total:
        log.info("prepare: skipped %d bad records: %s (listed in manifest.json)", skipped.total, dict(skipped.by_reason))
    return manifest


def warn_empty_splits(splits: dict, val_fraction: float, rule: str = "hash", sources: list[dict] = ()) -> None:
    """A split that received no document (few documents, a small ``val_fraction``) is worth a
    warning: pre-training on it would report no validation loss, or have nothing to train on;
    so is a source that went wholly to val under a per-source rule (too few documents for its share)."""
    n_docs = sum(s["n_docs"] for s in splits.values())
    if rule == "hash" and val_fraction > 0 and splits["val"]["n_docs"] == 0:
        log.warning("prepare: the validation split is empty: none of the %d documents hashed into val_fraction=%g; "
                    "pretrain will report no validation loss (raise val_fraction, add documents, or use "
                    "split=source_hash or source_tail)", n_docs, val_fraction)
    if splits["train"]["n_docs"] == 0 and rule == "files":
        log.warning("prepare: the train split is empty: data.paths gave no document, all %d are the validation "
                    "files'", n_docs)
    elif splits["train"]["n_docs"] == 0:
        how = "hashed into" if rule == "hash" else f"went to (split={rule}, val_fraction={val_fraction:g})"
        log.warning("prepare: the train split is empty: all %d documents %s the validation split; lower "
                    "val_fraction or add documents", n_docs, how)
    elif rule in ("source_hash", "source_tail"):
        for source in sources:
            if source["n_docs"] and source["val_docs"] == source["n_docs"]:
                log.warning("prepare: all %d documents of %s went to the validation split (split=%s, val_fraction=%g): "
                            "too few for a train share%s", source["n_docs"], source["path"], rule, val_fraction,
                            " (split=source_tail cuts a one-document file by characters)" if rule == "source_hash" else "")


def verify_outputs(recipe: PrepareRecipe) -> None:
    """Hash every shard in ``run_dir`` against its manifest (an ``InputError`` names the first that
    differs): what the lifecycle runner checks before reusing a completed prepare."""
    for split in SPLITS:
        open_shards(recipe.run_dir, split, verify=True)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report."""
    s = res.get("splits", {})
    rule = res.get("split", {"rule": "hash", "val_fraction": res.get("val_fraction")})  # absent before split rules
    how = (f"validation files {rule.get('val_paths')}" if rule["rule"] == "files"
           else f"split {rule['rule']}, val_fraction {rule.get('val_fraction')}")
    return [f"- {res.get('n_docs')} documents, {res.get('n_tokens')} tokens ({res.get('dtype')}): "
            f"train {s.get('train', {}).get('n_tokens')} / val {s.get('val', {}).get('n_tokens')} tokens ({how})",
            f"- skipped records: {res.get('skipped', {}).get('total', 0)}"]


RECIPE = PrepareRecipe
run = run_prepare
