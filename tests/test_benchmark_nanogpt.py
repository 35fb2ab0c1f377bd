"""benchmarks/nanogpt.py at its smallest size: lmforge alone against nanoGPT's README figure, and
beside a stand-in nanoGPT checkout whose train.py prints nanoGPT's log lines (the parser's test,
without nanoGPT). No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "nanogpt.py"
FAKE_LOSSES = {0: 4.25, 4: 3.125, 8: 2.5}  # the stand-in's validation loss at each evaluation


def run(*args: object) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"nanogpt.py exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def read_result(path: Path) -> dict:
    result = json.loads(path.read_text())
    assert result["benchmark"] == "nanogpt" and result["quick"] is True and result["threads"] == 1
    assert result["date"] and result["commit"] and result["command"].startswith("python benchmarks/nanogpt.py --quick")
    assert result["machine"]["cpu"] and result["machine"]["summary"]
    assert result["text"]["chars"] == 40_000 and result["text"]["split"] == {
        "train_chars": 36_000, "val_chars": 4_000, "identical": True}
    return result


def check_lmforge_side(side: dict) -> None:
    assert [e["step"] for e in side["evals"]] == [4, 8]
    assert all(0 < e["val_loss"] < 6 and math.isfinite(e["val_loss"]) for e in side["evals"])
    assert 0 < side["evals"][0]["wall_s"] < side["evals"][1]["wall_s"] <= side["wall_s"]
    assert side["cpu_s"] > 0 and set(side["load_average"]) == {"before", "after"}


def test_quick_run_trains_both_recipes_on_the_same_split_and_compares_with_the_readme_loss(tmp_path):
    out, plot = tmp_path / "nanogpt.json", tmp_path / "nanogpt.png"
    stdout = run("--quick", "--runs", tmp_path / "runs", "--out", out, "--plot", plot)
    result = read_result(out)
    assert list(result["sides"]) == ["lmforge_fast", "lmforge_gpt2"]
    for side in result["sides"].values():
        check_lmforge_side(side)
    assert result["sides"]["lmforge_gpt2"]["recipe"] == "recipes/nanogpt/shakespeare_char.yaml"
    summary = result["summary"]
    assert summary["target_val_loss"] == 1.88 and "README" in summary["target_from"]
    assert summary["reference"].startswith("proxy: lmforge_gpt2")
    assert summary["reference_wall_s"] == result["sides"]["lmforge_gpt2"]["evals"][-1]["wall_s"]
    assert summary["sides"]["lmforge_fast"]["reached"] is False and summary["goal_met"] is False  # 8 steps: far off
    assert plot.is_file() and "goal (lmforge_fast" in stdout


def write_fake_nanogpt(root: Path) -> None:
    """A checkout of the five files the benchmark copies: prepare.py cuts as nanoGPT's does, train.py
    records its arguments and prints nanoGPT's log lines."""
    files = {
        "model.py": "", "configurator.py": "", "config/train_shakespeare_char.py": "",
        "data/shakespeare_char/prepare.py": """
            import os, pickle
            import numpy as np
            here = os.path.dirname(__file__)
            data = open(os.path.join(here, 'input.txt')).read()
            chars = sorted(set(data))
            stoi = {ch: i for i, ch in enumerate(chars)}
            n = len(data)
            for name, part in (('train', data[:int(n*0.9)]), ('val', data[int(n*0.9):])):
                np.array([stoi[c] for c in part], dtype=np.uint16).tofile(os.path.join(here, name + '.bin'))
            pickle.dump({'vocab_size': len(chars), 'itos': dict(enumerate(chars)), 'stoi': stoi},
                        open(os.path.join(here, 'meta.pkl'), 'wb'))
            """,
        "train.py": f"""
            import json, sys
            json.dump(sys.argv[1:], open('argv.json', 'w'))
            args = dict(a[2:].split('=', 1) for a in sys.argv[2:])
            assert open('data/shakespeare_char/train.bin', 'rb').read(), 'no train.bin'
            print('tokens per iteration will be: 768')
            losses = {FAKE_LOSSES!r}
            for it in range(int(args['max_iters']) + 1):
                if it % int(args['eval_interval']) == 0:
                    print(f"step {{it}}: train loss {{losses[it] - 0.1:.4f}}, val loss {{losses[it]:.4f}}")
                print(f"iter {{it}}: loss {{3.0:.4f}}, time {{10.0 + it:.2f}}ms, mfu -100.00%")
            """,
    }
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(body))


def test_nanogpt_side_runs_a_copy_of_the_checkout_and_its_loss_is_the_target(tmp_path):
    checkout, runs = tmp_path / "nanoGPT", tmp_path / "runs"
    write_fake_nanogpt(checkout)
    before = {p: p.stat().st_mtime_ns for p in checkout.rglob("*")}
    out = tmp_path / "nanogpt.json"
    run("--quick", "--nanogpt", checkout, "--sides", "nanogpt", "lmforge_fast", "--runs", runs, "--out", out,
        "--plot", tmp_path / "nanogpt.png")
    assert {p: p.stat().st_mtime_ns for p in checkout.rglob("*")} == before  # nothing written into the checkout
    result = read_result(out)
    nanogpt = result["sides"]["nanogpt"]
    assert [(e["step"], e["val_loss"]) for e in nanogpt["evals"]] == sorted(FAKE_LOSSES.items())
    assert nanogpt["split"] == result["text"]["split"] and nanogpt["median_iter_ms"] == 14.5
    assert nanogpt["checkout"]["git_commit"] is None and set(nanogpt["checkout"]["sha256"]) >= {"train.py", "model.py"}
    argv = json.loads((runs / "nanogpt" / "argv.json").read_text())
    assert argv[:13] == ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                         "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                         "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
    assert "--max_iters=8" in argv[13:]  # --quick's, after the README's: nanoGPT's configurator keeps the last
    check_lmforge_side(result["sides"]["lmforge_fast"])
    summary = result["summary"]
    assert summary["target_val_loss"] == 2.5 and summary["reference"] == "nanogpt"
    assert summary["reference_wall_s"] == nanogpt["evals"][-1]["wall_s"]
    fast = summary["sides"]["lmforge_fast"]
    assert isinstance(fast["goal_met"], bool) and fast["goal_met"] == (fast["reached"] and fast["wall_ratio"] <= 1 / 3)
