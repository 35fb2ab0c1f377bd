import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from lmforge.core.config import ConfigError, load_config
from lmforge.data.loader import TokenLoader
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.loop import TrainConfig
from lmforge.train.metrics import loss_curve_lines, read_metrics
from lmforge.train.optim import build_adamw
from lmforge.train.spikes import SpikeConfig, SpikeDetector, SpikeGuard, z_score
from lmforge.train.step import StepRunner

SAMPLES_PER_STEP = 8  # make_recipe: micro-batches of 4 sequences, 2 per step (batch_tokens 256 / 4 x 32)


def detector(window=8, threshold=3.0, min_observations=4, max_consecutive=10) -> SpikeDetector:
    return SpikeDetector(window, threshold, min_observations, max_consecutive)


# --------------------------------------------------------------------------- the decision


def test_z_score_is_the_distance_from_the_mean_in_sample_standard_deviations():
    z, mean, std = z_score([1.0, 2.0, 3.0], 5.0)
    assert (mean, std, z) == (2.0, 1.0, 3.0)
    assert z_score([2.0, 2.0], 2.5)[0] == math.inf and z_score([2.0, 2.0], 1.0)[0] == 0.0


def test_a_loss_far_above_the_window_is_a_spike_and_stays_out_of_the_window():
    d = detector()
    for loss in (3.0, 3.1, 2.9, 3.0):
        assert d.judge(loss) is None
    z, mean, std = d.judge(9.0)
    assert z == pytest.approx((9.0 - 3.0) / std) and mean == pytest.approx(3.0)
    assert list(d.losses) == [3.0, 3.1, 2.9, 3.0]


def test_nothing_is_judged_before_the_minimum_number_of_losses():
    d = detector(min_observations=4)
    assert [d.judge(x) for x in (3.0, 3.0, 3.1, 50.0)] == [None] * 4
    assert d.judge(500.0) is not None


def test_a_falling_loss_is_never_a_spike():
    d = detector()
    for loss in (3.0, 3.1, 2.9, 3.0):
        d.judge(loss)
    assert d.judge(0.1) is None


def test_the_window_holds_the_last_accepted_losses_only():
    d = detector(window=4, min_observations=2, threshold=100.0)
    for loss in range(10):
        d.judge(float(loss))
    assert list(d.losses) == [6.0, 7.0, 8.0, 9.0]


def test_a_run_of_spikes_means_a_new_loss_level_and_restarts_the_window():
    d = detector(max_consecutive=3)
    for loss in (3.0, 3.1, 2.9, 3.0):
        d.judge(loss)
    assert all(d.judge(6.0) is not None for _ in range(3))
    assert len(d.losses) == 0
    assert [d.judge(6.0) for _ in range(4)] == [None] * 4  # the new level fills the new window


def test_the_detector_resumes_from_its_state():
    a = detector()
    for loss in (3.0, 3.1, 2.9, 3.0, 3.05):
        a.judge(loss)
    b = detector()
    b.load_state_dict(a.state_dict())
    assert [a.judge(x) for x in (3.2, 9.0)] == [b.judge(x) for x in (3.2, 9.0)]


def guard(policy, **kw) -> SpikeGuard:
    g = SpikeGuard(SpikeConfig(policy=policy, window=8, threshold=3.0, min_observations=4, **kw))
    for step, loss in enumerate((3.0, 3.1, 2.9, 3.0)):
        assert g.judge(step + 1, loss)
    return g


@pytest.mark.parametrize(("policy", "applied", "action"), [("warn", True, "warned"), ("skip", False, "skipped"),
                                                           ("rollback", False, "rolled_back")])
def test_each_policy_applies_or_drops_the_update_of_a_spike(policy, applied, action):
    g = guard(policy)
    assert g.judge(5, 9.0) is applied
    event = g.take_event()
    assert (event.step, event.action, event.policy) == (5, action, policy)
    assert (9.0 in g.detector.losses) is applied  # an applied update's loss joins the window
    assert g.take_event() is None


def test_rollback_falls_back_to_skipping_past_max_rollbacks_and_while_replaying():
    g = guard("rollback", max_rollbacks=2)
    g.rollbacks = [{"step": 10}]
    assert not g.judge(9, 9.0) and g.take_event().action == "skipped"  # replaying steps up to 10
    assert not g.judge(11, 9.0) and g.take_event().action == "rolled_back"
    g.rollbacks.append({"step": 11})
    assert not g.judge(20, 9.0) and g.take_event().action == "skipped"


class FakeLoader:
    def __init__(self, samples):
        self.samples, self.skips = samples, []

    def skip_samples(self, start, stop):
        self.skips.append((start, stop))


def test_a_rollback_skips_from_the_checkpoint_through_the_spike_and_the_steps_asked_after_it():
    g = guard("rollback", skip_steps_after=2)
    assert not g.judge(14, 9.0)
    loader = FakeLoader(samples=96)  # restored to the checkpoint of step 12
    g.rolled_back(g.take_event(), 12, loader, spike_samples_end=112, samples_per_step=8)
    assert loader.skips == [(96, 128)] and g.rollbacks[-1]["skipped_samples"] == [96, 128]
    assert not g.judge(20, 9.0)
    again = FakeLoader(samples=96)  # the same checkpoint again: both rollbacks' samples are skipped
    g.rolled_back(g.take_event(), 12, again, spike_samples_end=160, samples_per_step=8)
    assert again.skips == [(96, 128), (96, 176)]


def test_spike_settings_are_checked_with_the_key_named():
    with pytest.raises(ConfigError, match="train.spikes.min_observations"):
        load_config(TrainConfig, None, ["spikes.window=8", "spikes.min_observations=20"])
    with pytest.raises(ConfigError, match="spikes.policy"):
        load_config(TrainConfig, None, ["spikes.policy=restart"])
    assert load_config(TrainConfig, None, ["spikes.policy=rollback"]).spikes.policy == "rollback"


def test_rollback_needs_a_loader_that_can_skip_samples():
    with pytest.raises(ValueError, match="policy=rollback needs a loader"):
        SpikeGuard(SpikeConfig(policy="rollback")).check_loader(iter([]))


def test_spikes_are_off_by_default():
    assert TrainConfig().spikes.policy == "off"


# --------------------------------------------------------------------------- fault injection


def served_samples(loader: TokenLoader) -> list[int]:
    """The global sample numbers of ``loader``'s next batch, on its rank."""
    ids, i = [], loader.samples
    while len(ids) < loader.batch_size * loader.world_size:
        i = loader.skipped.next_kept(i)
        ids.append(i)
        i += 1
    return ids[loader.rank * loader.batch_size : (loader.rank + 1) * loader.batch_size]


def poisoned_next(ranges, real=TokenLoader.__next__):
    """A ``TokenLoader.__next__`` that serves rows of padding tokens in place of the global samples
    in ``ranges`` (``(start, stop)`` pairs): pre-training never sees padding, so the model has
    learnt to rule it out and the loss of such a corrupted batch spikes. On every rank alike."""

    def corrupted(self):
        ids = served_samples(self)
        batch = real(self)
        for row, i in enumerate(ids):
            if any(a <= i < b for a, b in ranges):
                batch[row] = PAD
        return batch

    return corrupted


@pytest.fixture()
def poison(monkeypatch):
    """``poison((start, stop), ...)``: the training loader corrupts those samples (``poisoned_next``)."""

    def inject(*ranges: tuple[int, int]) -> None:
        monkeypatch.setattr(TokenLoader, "__next__", poisoned_next(ranges))

    return inject


def skipping_from_the_start(monkeypatch, start: int, stop: int) -> None:
    """The training loader of the next runs skips samples ``start .. stop - 1`` from its first batch."""
    real = TokenLoader.__init__

    def init(self, cfg, batch_size, *, split="train", **kw):
        real(self, cfg, batch_size, split=split, **kw)
        if split == "train":
            self.skip_samples(start, stop)

    monkeypatch.setattr(TokenLoader, "__init__", init)


PAD = 2
SPIKES = {"train.lr": 1e-2, "train.spikes.window": 8, "train.spikes.min_observations": 4, "train.spikes.threshold": 6.0}


def spike_recipe(make_recipe, run_dir, policy, **overrides):
    return make_recipe(run_dir, **{"train.max_steps": 20, "train.warmup_steps": 2, "train.checkpoint_every": 4,
                                   "train.eval_every": 0, "train.spikes.policy": policy, **SPIKES, **overrides})


def final_weights(summary: dict) -> dict:
    return load_file(f"{summary['checkpoint']}/model.safetensors")


def step_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def test_a_corrupted_batch_is_rolled_back_to_the_run_that_never_saw_it_bit_exactly(make_recipe, tmp_path, poison,
                                                                                 monkeypatch):
    spike_step = 14  # its samples: [104, 112); the checkpoint before it: step 12, at sample 96
    poison(((spike_step - 1) * SAMPLES_PER_STEP, spike_step * SAMPLES_PER_STEP))
    rolled = run_pretrain(spike_recipe(make_recipe, tmp_path / "rolled", "rollback"))
    [event] = read_metrics(tmp_path / "rolled", events=True)
    assert (event["step"], event["action"], event["rollback_to"]) == (spike_step, "rolled_back", 12)
    assert event["skipped_samples"] == [96, 112] and event["spike_z"] > 6
    run_pretrain(spike_recipe(make_recipe, tmp_path / "parts", "rollback", **{"train.stop_at_step": 16}))
    resumed = run_pretrain(spike_recipe(make_recipe, tmp_path / "parts", "rollback"))  # skips them again
    assert resumed["start_step"] == 16

    monkeypatch.undo()
    skipping_from_the_start(monkeypatch, 96, 112)
    clean = run_pretrain(spike_recipe(make_recipe, tmp_path / "clean", "rollback"))
    assert read_metrics(tmp_path / "clean", events=True) == []
    for run in (rolled, resumed):
        a, b = final_weights(run), final_weights(clean)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert step_losses(tmp_path / "rolled") == step_losses(tmp_path / "clean")  # steps 1..20, each once
    assert [s for s, _ in step_losses(tmp_path / "rolled")] == list(range(1, 21))
    assert read_metrics(tmp_path / "parts", events=True) == [event]

    report = loss_curve_lines(tmp_path / "rolled", tmp_path / "loss.png")
    rows = [line for line in report if line.startswith("| 14 |")]
    assert len(rows) == 1 and "rolled back to step 12, samples [96, 112) skipped" in rows[0]


def test_a_spike_while_replaying_after_a_rollback_is_skipped(make_recipe, tmp_path, poison):
    poison((104, 112), (112, 120))  # step 14's samples, then those that replayed step 13 is served
    run_pretrain(spike_recipe(make_recipe, tmp_path / "run", "rollback"))
    events = read_metrics(tmp_path / "run", events=True)
    assert [(e["step"], e["action"]) for e in events] == [(14, "rolled_back"), (13, "skipped")]


def test_a_spike_before_the_first_checkpoint_is_skipped(make_recipe, tmp_path, poison):
    poison((104, 112))  # step 14; the first checkpoint is at step 16
    run_pretrain(spike_recipe(make_recipe, tmp_path / "run", "rollback", **{"train.checkpoint_every": 16,
                                                                             "train.max_steps": 15}))
    [event] = read_metrics(tmp_path / "run", events=True)
    assert (event["step"], event["action"]) == (14, "skipped")


@pytest.mark.parametrize(("policy", "applied"), [("skip", False), ("warn", True)])
def test_skip_leaves_the_weights_of_a_spiking_step_as_they_were_and_warn_applies_them(make_recipe, tmp_path, poison,
                                                                                    policy, applied):
    poison((104, 112))
    run_pretrain(spike_recipe(make_recipe, tmp_path / "run", policy, **{"train.max_steps": 15,
                                                                         "train.checkpoint_every": 1,
                                                                         "train.keep_checkpoints": 3}))
    ckpts = tmp_path / "run" / "checkpoints"
    before, after = (load_file(ckpts / f"step_{s:08d}" / "model.safetensors") for s in (13, 14))
    assert all(torch.equal(before[k], after[k]) for k in before) is not applied
    [event] = read_metrics(tmp_path / "run", events=True)
    assert (event["step"], event["policy"]) == (14, policy)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 16))  # a skipped step is a step


def test_a_dropped_update_under_fp16_loss_scaling_changes_nothing_and_the_next_step_runs():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    optimizer = build_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    runner = StepRunner(model, CausalLMObjective(), optimizer, "fp16", 1.0)  # with a loss scaler
    batch = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    runner.run_step([batch], accept=lambda loss: False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not optimizer.state
    runner.run_step([batch], accept=lambda loss: True)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("recipe", "policy"), [("distributed/gpu_fsdp_tp", "skip"), ("distributed/gpu_pp", "skip"),
                                                ("distributed/llama3_405b", "skip"), ("demo/pretrain", "off")])
def test_the_large_model_recipes_skip_loss_spikes_and_the_tiny_demo_does_not(recipe, policy):
    from pathlib import Path

    from lmforge.stages.pretrain import PretrainRecipe

    path = Path(__file__).parents[2] / "recipes" / f"{recipe}.yaml"
    assert load_config(PretrainRecipe, path).train.spikes.policy == policy
