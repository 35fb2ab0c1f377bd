"""Throughput of `lmforge prepare` against plain `tokenizers` encode_batch on the same text.

    python benchmarks/prepare.py [--data 'data/pretrain/*.jsonl'] [--repeats 3]

The peer is `Tokenizer.encode_batch` over the documents already in memory: the cost of
tokenization alone. `encode_batch_fast` (no character offsets), which lmforge itself
calls, is reported beside it so the gain from skipping offsets is visible. lmforge's figure is the whole `prepare` run: reading and parsing
JSONL, tokenizing, splitting, writing shards and the manifest. Both use the same
tokenizer and text; runs alternate and the best of N is kept. Target ratio: >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from record import command, commit, machine, now

from lmforge.core.io import expand_paths
from lmforge.data.documents import DocumentsConfig, read_documents
from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer
from lmforge.stages.prepare import PrepareRecipe, run_prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/pretrain/*.jsonl", help="documents (glob)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: train one, vocab 8192)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/prepare.json")
    args = parser.parse_args()

    started = now()
    docs_cfg = DocumentsConfig(paths=[args.data])
    texts = [d.text for d in read_documents(docs_cfg)]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    input_bytes = sum(p.stat().st_size for p in expand_paths(docs_cfg.paths))
    with tempfile.TemporaryDirectory() as tmp:
        if args.tokenizer:
            tok_dir = args.tokenizer
        else:
            tok_dir = str(Path(tmp) / "tok")
            train_tokenizer(texts, TokenizerConfig(vocab_size=8192)).save(tok_dir)
        tok = Tokenizer.load(tok_dir)

        peer_times, fast_times, ours_times = [], [], []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            encodings = tok.hf.encode_batch(texts, add_special_tokens=False)
            peer_times.append(time.perf_counter() - t0)
            n_tokens = sum(len(e.ids) for e in encodings)
            del encodings
            t0 = time.perf_counter()
            tok.hf.encode_batch_fast(texts, add_special_tokens=False)
            fast_times.append(time.perf_counter() - t0)

            recipe = PrepareRecipe(run_dir=str(Path(tmp) / f"shards{i}"), tokenizer=tok_dir, data=docs_cfg)
            t0 = time.perf_counter()
            run_prepare(recipe)
            ours_times.append(time.perf_counter() - t0)

    peer, fast, ours = min(peer_times), min(fast_times), min(ours_times)
    result = {
        "benchmark": "prepare",
        "date": started,
        "command": command("prepare.py", None),
        "commit": commit(),
        "machine": machine(),
        "text_megabytes": round(n_bytes / 1e6, 3),
        "input_file_megabytes": round(input_bytes / 1e6, 3),
        "documents": len(texts),
        "tokens": n_tokens,
        "lmforge_prepare_mb_per_s": round(n_bytes / ours / 1e6, 3),
        "tokenizers_encode_batch_mb_per_s": round(n_bytes / peer / 1e6, 3),
        "tokenizers_encode_batch_fast_mb_per_s": round(n_bytes / fast / 1e6, 3),
        "ratio": round(peer / ours, 3),
        "ratio_vs_encode_batch_fast": round(fast / ours, 3),
        "target_ratio": 0.8,
        "times_s": {"lmforge_prepare": [round(t, 3) for t in ours_times], "encode_batch": [round(t, 3) for t in peer_times],
                    "encode_batch_fast": [round(t, 3) for t in fast_times]},
    }
    print(f"{'':28}{'MB/s':>10}")
    print(f"{'tokenizers encode_batch':28}{result['tokenizers_encode_batch_mb_per_s']:>10.2f}")
    print(f"{'tokenizers encode_batch_fast':28}{result['tokenizers_encode_batch_fast_mb_per_s']:>10.2f}")
    print(f"{'lmforge prepare':28}{result['lmforge_prepare_mb_per_s']:>10.2f}")
    print(f"{'ratio vs encode_batch':28}{result['ratio']:>10.3f}   (target >= 0.8)")
    print(f"{'ratio vs encode_batch_fast':28}{result['ratio_vs_encode_batch_fast']:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
