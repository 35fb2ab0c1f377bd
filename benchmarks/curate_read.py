"""Reading a big input cut into shards: every shard read one after another, against the same
file read in one piece, side by side in one run.

    python benchmarks/curate_read.py [--records 200000] [--shards 20 100] [--repeats 3]

`lmforge curate` cuts each input file into shards of `records_per_shard` records and reads
each shard on its own (in parallel workers). The counting pass notes where each shard's first
record begins, so a shard seeks there instead of parsing the records before it: reading all
K shards should cost about one read of the file, not K/2 of them. The figure is
(time to plan and read all shards) / (time to plan and read the file as one shard); target
<= 1.3 for plain JSONL, WARC and .warc.gz (one gzip member per record, the usual layout).
A gzip JSONL stream cannot be entered in the middle: each shard still decompresses from
the top (without parsing), so its ratio grows with the shard count; for many shards of a
big compressed JSONL file, split the file instead. The inputs are generated under --workdir.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from record import command, commit, machine, now  # noqa: E402

from lmforge.curate.readers import InputsConfig, plan_shards, read_piece  # noqa: E402
from tests.curate.warc_fixtures import PROSE, html_record, write_warc  # noqa: E402


def make_inputs(workdir: Path, records: int) -> dict[str, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    files = {"jsonl": workdir / f"docs-{records}.jsonl", "jsonl.gz": workdir / f"docs-{records}.jsonl.gz",
             "warc": workdir / f"pages-{records // 10}.warc", "warc.gz": workdir / f"pages-{records // 10}.warc.gz"}
    if not files["jsonl"].exists():
        text = "".join(json.dumps({"id": f"d{i}", "text": f"document {i} " + PROSE["en"][:150]}) + "\n"
                       for i in range(records))
        files["jsonl"].write_text(text)
        files["jsonl.gz"].write_bytes(gzip.compress(text.encode(), compresslevel=6))
    for key, gz in (("warc", False), ("warc.gz", True)):  # WARC records are bigger: a tenth as many
        if not files[key].exists():
            write_warc(files[key], [html_record(f"https://example.org/{i}", PROSE["en"]) for i in range(records // 10)], gzip=gz)
    return files


def read_all(path: Path, records_per_shard: int) -> tuple[float, int, int]:
    cfg = InputsConfig(paths=[str(path)], records_per_shard=records_per_shard)
    t0 = time.perf_counter()
    shards = plan_shards(cfg)
    n = sum(1 for shard in shards for piece in shard for _ in read_piece(piece, cfg))
    return time.perf_counter() - t0, n, len(shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000, help="JSONL lines (WARC records: a tenth)")
    parser.add_argument("--shards", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/lmforge-bench-curate-read")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/curate_read.json"))
    args = parser.parse_args()

    started, rows = now(), []
    for kind, path in make_inputs(Path(args.workdir), args.records).items():
        total = args.records // 10 if kind.startswith("warc") else args.records
        for k in args.shards:
            best_sharded = best_whole = float("inf")
            for _ in range(args.repeats):  # alternate the two sides; keep the best of each
                t, n, n_shards = read_all(path, -(-total // k))
                best_sharded = min(best_sharded, t)
                t, m, _ = read_all(path, 0)
                best_whole = min(best_whole, t)
                if n != m:
                    raise RuntimeError(f"{path}: {n} documents from the shards, {m} from the whole file")
            rows.append({"input": kind, "records": total, "shards": n_shards, "sharded_s": round(best_sharded, 6),
                         "one_piece_s": round(best_whole, 6), "ratio": round(best_sharded / best_whole, 3)})
            r = rows[-1]
            print(f"{kind:9s} {total:>7d} records {r['shards']:>4d} shards: all shards {r['sharded_s']:6.2f} s, "
                  f"one piece {r['one_piece_s']:6.2f} s, ratio {r['ratio']:.2f}", flush=True)
    result = {"benchmark": "curate_read", "date": started, "command": command("curate_read.py", None),
              "commit": commit(), "machine": machine(),
              "figure": "(plan + read all shards) / (plan + read the file as one shard), best of repeats",
              "target_ratio_at_most": {"jsonl": 1.3, "warc": 1.3, "warc.gz": 1.3}, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
