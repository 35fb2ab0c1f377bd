"""Kill -9 at seeded points of each stage, resume, and get what an uninterrupted run gets.

Each test hands ``kill_driver`` a tiny run: it kills the stage at least ``KILLS`` times (mid-step,
mid-checkpoint write, mid-metrics line, mid-prepare, mid-curate segment), resumes it after
each kill until it finishes, and then requires, per finished run, no temporary file or folder
left behind and the same outputs as an uninterrupted run: bit-identical metrics and final
weights for training, byte-identical files for prepare and curate. ``LMFORGE_SOAK=1`` kills
ten times as often with a random seed (``LMFORGE_SOAK=N``: N times), to look for new failures.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.data.documents import DocumentsConfig
from lmforge.data.sft_demo import write_demo
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from tests.conftest import REPO, write_jsonl

SOAK = int(os.environ.get("LMFORGE_SOAK") or 0)
KILLS = 20 * ((10 if SOAK == 1 else SOAK) if SOAK else 1)
TINY_MODEL = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.ffn_hidden=64"]
TINY_TRAINING = ["train.lr=3e-3", "train.warmup_steps=1", "train.micro_batch_size=4", "train.precision=fp32",
                 "train.tensorboard=false", "train.device=cpu", "train.checkpoint_every=2", "train.keep_checkpoints=2"]


def seed_for(name: str) -> int:
    """A fixed seed per test; under LMFORGE_SOAK a random one, printed so a failure can be replayed."""
    if not SOAK:
        return sum(map(ord, name))
    seed = random.SystemRandom().randrange(2**32)
    print(f"{name}: seed {seed}")
    return seed


def killed_and_resumed(tmp_path: Path, stage: str, **inputs) -> dict:
    """Run ``kill_driver`` on ``stage``; fail with its problems, else return its result."""
    work = tmp_path / "kills"
    work.mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"stage": stage, "work": str(work), "seed": seed_for(stage), "kills": KILLS, **inputs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.reliability.kill_driver", str(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=None if SOAK else 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((work / "result.json").read_text())
    print(f"{stage}: {result.get('kills')} kills in {result.get('cycles')} runs, {result.get('compared')} compared: "
          f"{result.get('kills_by_point')}")
    assert not result["problems"], "\n".join(result["problems"])
    assert result["kills"] >= KILLS and result["compared"] == result["cycles"]
    return result


def kinds(result: dict) -> set[str]:
    return {point.split(":")[0] for point in result["kills_by_point"]}


@pytest.fixture(scope="module")
def documents(tmp_path_factory, corpus_texts) -> Path:
    root = tmp_path_factory.mktemp("kill_docs")
    return write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])


@pytest.fixture(scope="module")
def shards(tmp_path_factory, documents, small_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("kill_shards") / "shards"
    run_prepare(PrepareRecipe(run_dir=str(out), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(documents)]), val_fraction=0.1))
    return out


def test_pretraining_killed_anywhere_resumes_to_the_uninterrupted_losses_and_weights(tmp_path, shards,
                                                                                     small_tokenizer_dir):
    result = killed_and_resumed(tmp_path, "pretrain", overrides=[
        f"tokenizer={small_tokenizer_dir}", *TINY_MODEL, "model.max_seq_len=64", f"data.datasets=[{{path: {shards}}}]",
        "data.seq_len=32", "train.max_steps=6", "train.batch_tokens=256", "train.eval_every=3", "train.eval_batches=1",
        *TINY_TRAINING])
    assert kinds(result) == {"step", "checkpoint", "metrics", "run"}


def test_sft_killed_anywhere_resumes_to_the_uninterrupted_losses_and_weights(tmp_path, small_tokenizer_dir):
    import torch

    from lmforge.checkpoints.files import write_checksums, write_model_files
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer

    base, data = tmp_path / "base", tmp_path / "sft_data"
    base.mkdir()
    torch.manual_seed(0)
    write_model_files(base, Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                    ffn_hidden=64, max_seq_len=128)), small_tokenizer_dir)
    write_checksums(base)
    write_demo(data, 60, seed=0, val_fraction=0.1)
    result = killed_and_resumed(tmp_path, "sft", overrides=[
        f"checkpoint={base}", f"data.train=[{data / 'train.jsonl'}]", f"data.val=[{data / 'val.jsonl'}]",
        "data.max_length=128", "train.max_steps=6", "train.eval_every=3", "train.eval_batches=1",
        "score.name=exact_match", "score.max_examples=2", "score.max_new_tokens=4", *TINY_TRAINING])
    assert kinds(result) == {"step", "checkpoint", "metrics", "run"}


def test_prepare_killed_anywhere_reruns_to_byte_identical_shards(tmp_path, documents, small_tokenizer_dir):
    result = killed_and_resumed(tmp_path, "prepare", overrides=[
        f"tokenizer={small_tokenizer_dir}", f"data.paths=[{documents}]", "val_fraction=0.1", "shard_tokens=3000",
        "batch_docs=8"])
    assert {"prepare:shard-file", "prepare:encode"} <= set(result["kills_by_point"])


def test_curate_killed_mid_segment_resumes_to_byte_identical_output_and_rejects(tmp_path):
    from tests.curate.test_pipeline import STEPS, story
    from tests.curate.warc_fixtures import html_record, write_warc

    records = [html_record(f"https://x.org/en/{i}", story(i)) for i in range(6)]
    records += [html_record("https://x.org/copy/0", story(0)), html_record("https://x.org/copy/3", story(3))]
    crawl = write_warc(tmp_path / "crawl.warc.gz", records)
    result = killed_and_resumed(tmp_path, "curate", config={
        "inputs": {"paths": [str(crawl)], "records_per_shard": 3}, "steps": [dict(s) for s in STEPS]})
    assert {"curate:filter", "curate:marker"} <= set(result["kills_by_point"])
