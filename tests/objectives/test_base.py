"""The extension point: an objective written as one subclass of ``Objective`` trains through ``train()``."""

import pytest
import torch

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.clm import causal_lm_loss
from lmforge.train.loop import TrainConfig, train
from lmforge.train.metrics import read_metrics


class L2PenalisedLM(Objective):
    """Next-token loss plus an L2 penalty on the weights, spread over the targets (the shape of
    EWC's penalty); it records every loss it returns, so the test can compare the loop's figures."""

    def __init__(self, weight: float):
        self.weight = weight
        self.returned: list[tuple[bool, float, float, int]] = []  # (training, loss sum, penalty sum, targets)

    def num_targets(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def num_tokens(self, batch: torch.Tensor) -> int:
        return batch.numel()  # differs from the targets: the loop must ask for it

    def __call__(self, model, batch: torch.Tensor) -> LossOutput:
        n = self.num_targets(batch)
        penalty = self.weight * sum((p.float() ** 2).sum() for p in model.parameters()) * n
        loss_sum = causal_lm_loss(model(batch[:, :-1]), batch[:, 1:]) + penalty
        self.returned.append((torch.is_grad_enabled(), loss_sum.item(), penalty.item(), n))
        return LossOutput(loss_sum, n, metrics={"penalty": penalty.detach()})


class FixedBatches:
    """Batch i is a fixed function of i; its rows cycle through ``rows``."""

    def __init__(self, rows: tuple[int, ...] = (2,)):
        self.i, self.rows = 0, rows

    def __next__(self) -> torch.Tensor:
        self.i += 1
        rows = self.rows[(self.i - 1) % len(self.rows)]
        return torch.randint(0, 50, (rows, 9), generator=torch.Generator().manual_seed(self.i))

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def test_a_custom_objective_trains_through_the_loop_which_logs_exactly_its_loss_and_metrics(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    objective = L2PenalisedLM(weight=1e-3)
    val = [torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(100 + i)) for i in range(2)]
    cfg = TrainConfig(max_steps=3, warmup_steps=0, lr=1e-2, precision="fp32", tensorboard=False, device="cpu",
                      eval_every=0, eval_batches=None)
    # micro-batches of 2 and 1 rows: unequal target counts, so a mean of means would differ from the loop's
    summary = train(model=model, objective=objective, train_batches=FixedBatches((2, 1)), cfg=cfg, run_dir=tmp_path,
                    recipe=cfg, grad_accum=2, val_batches=lambda: iter(val))
    records = read_metrics(tmp_path)
    trained = [r for r in objective.returned if r[0]]
    assert len(records) == 3 and len(trained) == 6
    for record, step in zip(records, [trained[i:i + 2] for i in range(0, 6, 2)]):
        targets = sum(n for *_, n in step)
        assert record["targets"] == targets == 8 * 2 + 8 * 1
        assert record["loss"] == pytest.approx(sum(loss for _, loss, _, _ in step) / targets, rel=1e-6)
        assert record["penalty"] == pytest.approx(sum(p for _, _, p, _ in step) / targets, rel=1e-6)
    assert records[-1]["tokens"] == 3 * (2 * 9 + 1 * 9)  # the objective's num_tokens, not its targets
    evaluated = [r for r in objective.returned if not r[0]]
    assert len(evaluated) == 2  # the final validation, in no-grad mode
    assert summary["val_loss"] == pytest.approx(sum(r[1] for r in evaluated) / sum(r[3] for r in evaluated), rel=1e-6)
    assert summary["val_penalty"] == pytest.approx(sum(r[2] for r in evaluated) / sum(r[3] for r in evaluated),
                                                   rel=1e-6)
    assert records[-1]["penalty"] < records[0]["penalty"]  # the penalty's gradient reaches the weights


def test_an_objective_that_is_not_an_objective_subclass_is_refused_naming_the_base(tmp_path):
    class NotAnObjective:
        def num_targets(self, batch):
            return 1

        def __call__(self, model, batch):
            return LossOutput(torch.zeros(()), 1)

    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    cfg = TrainConfig(max_steps=1, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu")
    with pytest.raises(TypeError, match=r"NotAnObjective is not an Objective: subclass lmforge\.objectives\.base\.Objective"):
        train(model=model, objective=NotAnObjective(), train_batches=FixedBatches(), cfg=cfg, run_dir=tmp_path,
              recipe=cfg)
