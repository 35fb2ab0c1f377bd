"""Train a byte-level BPE tokenizer with the `tokenizers` library on the configured
documents: special tokens (BOS, EOS, pad) and the ChatML turn markers take the first ids.
Saves tokenizer.json + tokenizer_config.json into run_dir (transformers'
PreTrainedTokenizerFast loads them) and reports compression, in bytes per token, on
held-out documents in stats.json.

  lmforge tokenizer recipes/demo/tokenizer.yaml tokenizer.vocab_size=4096
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.core.config import option, positive, unit_interval
from lmforge.core.io import InputError, atomic_write_json
from lmforge.core.run import log, progress_bar, record_config, run_dir_lock, start_run
from lmforge.data.documents import DocumentsConfig, SkipLog, read_documents, split_of
from lmforge.data.tokenizer import TokenizerConfig, compression_stats, train_tokenizer


@dataclass
class TokenizerRecipe:
    run_dir: str = option("runs/tokenizer", help="receives tokenizer.json, tokenizer_config.json, stats.json")
    data: DocumentsConfig = field(default_factory=DocumentsConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    heldout_fraction: float = unit_interval(
        0.05,
        high_open=True,
        help="Documents whose id hashes below this fraction are held out to measure compression. Use the same value "
        "as `prepare`'s val_fraction so the tokenizer never sees validation text.",
    )
    max_heldout_chars: int = positive(20_000_000, help="cap on the held-out text compression is measured on")

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")


def run_tokenizer(recipe: TokenizerRecipe) -> dict:
    with run_dir_lock(recipe.run_dir):  # a second run into it fails at once, naming this one
        return write_tokenizer(recipe)


def write_tokenizer(recipe: TokenizerRecipe) -> dict:
    """``run_tokenizer`` in its locked run directory."""
    run_dir = start_run(recipe, recipe.run_dir)
    skipped = SkipLog()
    heldout: list[str] = []
    counts = {"documents": 0, "chars": 0}
    bar = progress_bar(None, "reading documents", unit="doc")

    def training_texts() -> Iterator[str]:
        held_chars = 0
        for doc in read_documents(recipe.data, skipped):
            bar.update(1)
            if split_of(doc.id, recipe.heldout_fraction) == "val":
                if held_chars < recipe.max_heldout_chars:
                    heldout.append(doc.text)
                    held_chars += len(doc.text)
                continue
            counts["documents"] += 1
            counts["chars"] += len(doc.text)
            yield doc.text

    t0 = time.perf_counter()
    tok = train_tokenizer(training_texts(), recipe.tokenizer)
    seconds = time.perf_counter() - t0
    bar.close()
    if counts["documents"] == 0:
        raise InputError(f"no training documents in {recipe.data.paths} ({skipped.total} records skipped)")
    tok.save(run_dir)
    stats = {
        "vocab_size": tok.vocab_size,
        "special_tokens": recipe.tokenizer.special_tokens,
        "train": {**counts, "seconds": round(seconds, 3)},
        "heldout": compression_stats(tok, heldout) if heldout else None,
        "skipped": skipped.to_dict(),
        "tokenizer_sha256": tok.sha256,
    }
    atomic_write_json(run_dir / "stats.json", stats)
    record_config(recipe, run_dir)  # the config of the tokenizer now there
    log.info(
        "tokenizer: %d tokens learned from %d documents (%.1f MB) in %.1fs -> %s",
        tok.vocab_size, counts["documents"], counts["chars"] / 1e6, seconds, run_dir,
    )
    if stats["heldout"]:
        h = stats["heldout"]
        log.info("tokenizer: held-out compression %.3f bytes/token (%d documents, %d tokens)",
                 h["bytes_per_token"], h["documents"], h["tokens"])
    else:
        log.info("tokenizer: no held-out documents (heldout_fraction=%s); compression not measured", recipe.heldout_fraction)
    if skipped.total:
        log.info("tokenizer: skipped %d bad records: %s", skipped.total, dict(skipped.by_reason))
    return stats


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report."""
    h = res.get("heldout") or {}
    out = [f"- vocabulary: {res.get('vocab_size')} tokens, trained on {res['train']['documents']} documents "
           f"({res['train']['chars'] / 1e6:.2f} M characters) in {res['train']['seconds']:.1f} s"]
    if h:
        out.append(f"- held-out compression: **{h['bytes_per_token']:.3f} bytes/token** "
                   f"({h['documents']} documents, {h['tokens']} tokens)")
    return out


RECIPE = TokenizerRecipe
run = run_tokenizer
