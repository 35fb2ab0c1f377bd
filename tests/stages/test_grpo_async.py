"""Asynchronous GRPO rollouts (``lmforge.rl.workers``) on a tiny model: at ``max_off_policy_steps``
0 one worker gives the in-process run's losses bit for bit; at 1 the workers sample ahead and every
trained group is at most a step old; a dead worker stops the run with a clear error; a trainer
killed with ``kill -9`` and resumed trains on every prompt exactly once; bad keys are one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.checkpoints.load import latest_valid_checkpoint
from lmforge.core.config import ConfigError, load_config
from lmforge.rl.workers import AsyncRolloutBatches, RolloutWorkerError
from lmforge.stages.grpo import GRPORecipe, run_grpo
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl
from tests.stages.test_grpo import FAST, REWARD

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin
REPO = Path(__file__).resolve().parents[2]


def recipe(tmp_path, base, prompts, *overrides, name="grpo") -> GRPORecipe:
    return load_config(GRPORecipe, None, [f"run_dir={tmp_path / name}", f"checkpoint={base}",
                                          f"data.train=[{prompts}]", *FAST, *REWARD, "train.lr=1e-3",
                                          "objective.kl_coef=0", *overrides])


def test_staleness_zero_with_a_worker_is_the_in_process_run_bit_for_bit(tmp_path, base_checkpoint, prompts):
    common = ["train.max_steps=3", "grpo.updates_per_batch=2", "rollout.max_new_tokens=6"]
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, *common, name="inline"))
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, *common, "rl.rollout_workers=1", name="worker"))
    inline, worker = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "worker")
    assert [r["step"] for r in worker] == [1, 2, 3]
    for a, b in zip(inline, worker):
        for key in ("loss", "reward_mean", "ratio_max", "response_length_mean", "grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["off_policy_steps_max"] == 0 and b["stale_dropped"] == 0


def test_one_step_ahead_every_trained_sample_is_at_most_one_step_old(tmp_path, base_checkpoint, prompts):
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=4", "rl.rollout_workers=1",
                    "rl.max_off_policy_steps=1", "grpo.samples_every=1"))
    records = read_metrics(tmp_path / "grpo")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["off_policy_steps_max"] <= 1 for r in records)
    lines = [json.loads(line) for p in sorted((tmp_path / "grpo" / "samples").iterdir())
             for line in p.read_text().splitlines()]
    groups = [line["group"] for line in lines]
    assert sorted(set(groups)) == list(range(16)) and len(groups) == 16 * 4  # 4 steps x 4 prompts, n = 4 each
    for line in lines:  # each token's policy version, at most one step before the step that trains on it
        assert len(line["versions"]) == line["tokens"] and line["step"] - 2 <= min(line["versions"]) <= line["step"] - 1


def test_a_worker_that_dies_stops_the_run_with_a_clear_error(tmp_path, base_checkpoint, prompts, monkeypatch):
    real = AsyncRolloutBatches.draw_groups

    def kill_first(self):
        os.kill(self.pool.procs[0].pid, signal.SIGKILL)
        return real(self)

    monkeypatch.setattr(AsyncRolloutBatches, "draw_groups", kill_first)
    began = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 \(pid \d+\) died with exit code -9"):
        run_grpo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=2", "rl.rollout_workers=1"))
    assert time.monotonic() - began < 60


@pytest.mark.parametrize("override, message", [
    ("rl.max_off_policy_steps=-1", "rl.max_off_policy_steps"),
    ("rl.max_off_policy_steps=1", "needs rollout workers"),
    ("rl.partial_rollouts=maybe", "rl.partial_rollouts"),
])
def test_bad_async_keys_are_refused(tmp_path, base_checkpoint, prompts, override, message):
    with pytest.raises(ConfigError, match=message):
        recipe(tmp_path, base_checkpoint, prompts, override)


def test_ppo_refuses_rollout_workers_before_any_model_is_loaded():
    from lmforge.stages.ppo import PPORecipe, check_recipe

    with pytest.raises(ConfigError, match="ppo samples in-process"):
        check_recipe(load_config(PPORecipe, None, ["rl.rollout_workers=1"]))


def test_a_negative_staleness_is_one_line_and_exit_2_on_the_command_line(tmp_path, base_checkpoint, prompts):
    out = subprocess.run([sys.executable, "-m", "lmforge", "grpo", f"run_dir={tmp_path / 'r'}",
                          f"checkpoint={base_checkpoint}", f"data.train=[{prompts}]", "rl.max_off_policy_steps=-1"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "rl.max_off_policy_steps" in out.stderr and not (tmp_path / "r").exists()


def test_a_killed_trainer_resumes_with_every_prompt_trained_on_once(tmp_path, base_checkpoint):
    prompts = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"word {i} is", "id": i} for i in range(90)])
    args = [sys.executable, "-m", "lmforge", "grpo", f"run_dir={tmp_path / 'run'}", f"checkpoint={base_checkpoint}",
            f"data.train=[{prompts}]", *FAST, *REWARD, "train.lr=1e-3", "objective.kl_coef=0", "rollout.n=2",
            "grpo.prompts_per_step=3", "train.checkpoint_every=4", "grpo.samples_every=1",
            "rl.rollout_workers=1", "rl.max_off_policy_steps=2", "train.log_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*args, "train.max_steps=400"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = tmp_path / "run"
    try:  # killed once its first checkpoint is whole (a loaded machine may have written a later one by then)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and latest_valid_checkpoint(run_dir) is None and proc.poll() is None:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone: its workers see their parent gone and exit
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    found = latest_valid_checkpoint(run_dir)
    assert found is not None and proc.returncode == -signal.SIGKILL
    at = int(found.name.removeprefix("step_"))
    assert 4 <= at <= 24 and not (run_dir / "final").exists()
    state = json.loads((found / "trainer_state.json").read_text())
    assert state["loader"]["in_flight"], "the checkpoint holds the prompts in flight"
    end = at + 4
    summary = run_grpo(load_config(GRPORecipe, None, [*args[4:], f"train.max_steps={end}"]))  # resumed, in-process
    assert summary["start_step"] == at and summary["step"] == end
    lines = [json.loads(line) for step in range(1, end + 1)
             for line in (run_dir / "samples" / f"step-{step:06d}.jsonl").read_text().splitlines()]
    prompts_trained = [line["prompt"] for line in lines if line["sample"] == 0]
    assert len(prompts_trained) == end * 3 and len(set(prompts_trained)) == end * 3  # each exactly once, none lost
