"""benchmarks/doremi.py end to end at its smallest size: the reference, three DoReMi proxies, the main
model on each mixture, its JSON and figure, and the tables scripts/write_benchmark_docs.py renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, benchmark_docs_writer


@pytest.fixture()
def two_domains(tmp_path, corpus_texts, small_tokenizer_dir) -> list[str]:
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare
    from tests.conftest import write_jsonl

    out = []
    for name, texts in (("early", corpus_texts[:40]), ("late", corpus_texts[40:])):
        docs = write_jsonl(tmp_path / f"{name}.jsonl", [{"id": f"{name}{i}", "text": t} for i, t in enumerate(texts)])
        run_prepare(PrepareRecipe(run_dir=str(tmp_path / name), tokenizer=str(small_tokenizer_dir),
                                  data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
        out.append(f"{name}={tmp_path / name}")
    return out


def test_doremi_compares_the_mixtures_on_one_budget_and_records_three_seeds(tmp_path, two_domains,
                                                                            small_tokenizer_dir):
    out = tmp_path / "doremi.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "doremi.py"), "--quick", "--tokenizer",
                           str(small_tokenizer_dir), "--domains", *two_domains, "--runs", str(tmp_path / "runs"),
                           "--out", str(out), "--plot", str(tmp_path / "d.png")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "doremi" and result["command"].startswith("python benchmarks/doremi.py")
    assert result["domains"] == ["early", "late"] and [s["seed"] for s in result["seeds"]] == [0, 1, 2]
    rows = {r["mixture"]: r for r in result["rows"]}
    assert list(rows) == ["uniform", "stratified", "DoReMi"] and all(r["seeds"] == [0, 1, 2] for r in rows.values())
    manifests = [json.loads((tmp_path / n / "manifest.json").read_text())["splits"]["train"]["n_tokens"]
                 for n in ("early", "late")]
    assert result["stratified"]["early"] == pytest.approx(manifests[0] / sum(manifests), rel=1e-12)
    runs = result["runs"]
    assert [(r["mixture"], r["seed"]) for r in runs] == [(m, s) for m in rows for s in (0, 1, 2)]
    for seed in result["seeds"]:
        assert sum(seed["weights"].values()) == pytest.approx(1.0, abs=1e-12)
        assert next(r for r in runs if r["mixture"] == "DoReMi" and r["seed"] == seed["seed"])["weights"] == \
            seed["weights"]
    for run in runs:
        assert run["mean_loss"] == pytest.approx(sum(run["val_loss"].values()) / 2, rel=1e-12)
        assert run["worst_loss"] == max(run["val_loss"].values())
    for row in rows.values():
        mine = [r["mean_loss"] for r in runs if r["mixture"] == row["mixture"]]
        assert row["mean_loss"] == pytest.approx(sum(mine) / 3, rel=1e-12)
        assert row["mean_loss_range"] == [min(mine), max(mine)]
    # the uniform mixture's seed 0 is the reference run; each other run trained on its mixture and seed
    assert runs[0]["run_dir"] == str(tmp_path / "runs" / "reference")
    recorded = (tmp_path / "runs" / "main-doremi-seed1" / "config.yaml").read_text()
    assert "doremi-seed1/domain_weights.json" in recorded and "seed: 1" in recorded
    assert (tmp_path / "d.png").is_file()
    table = "\n".join(benchmark_docs_writer().render("doremi", result).lines)
    assert "| DoReMi seed 2 |" in table and "| DoReMi spread |" in table and "Lowest mean loss" in table
