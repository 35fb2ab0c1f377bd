"""Our DPO-family losses against torchtune's (``torchtune/rlhf/loss/dpo.py``), a reference library.

torchtune is installed without its dependencies (it is a test-only reference), so its
loss module, which needs only torch, is loaded from its file rather than through the
package, whose ``__init__`` imports torchtune's dataset stack.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from lmforge.objectives.preference import dpo_loss


def load_torchtune_dpo():
    spec = importlib.util.find_spec("torchtune")
    assert spec is not None and spec.submodule_search_locations, "torchtune (test dependency) is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "rlhf" / "loss" / "dpo.py"
    module_spec = importlib.util.spec_from_file_location("torchtune_dpo_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


TT = load_torchtune_dpo()


def logps(batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(batch, generator=g, dtype=torch.float64) * 40 + 1) for _ in range(4)]


@pytest.mark.parametrize("batch", [1, 5, 8])
@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_dpo_and_cdpo_equal_torchtune_dpoloss(batch, beta, smoothing):
    pc, pr, rc, rr = logps(batch, seed=batch)
    ours, our_c, our_r = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="cdpo" if smoothing else "sigmoid",
                                  label_smoothing=smoothing)
    theirs, their_c, their_r = TT.DPOLoss(beta=beta, label_smoothing=smoothing)(pc, pr, rc, rr)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(our_c, their_c)
    torch.testing.assert_close(our_r, their_r)


@pytest.mark.parametrize("batch", [3, 8])
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_hinge_equals_torchtune_rso_loss(batch, beta):
    pc, pr, rc, rr = logps(batch, seed=100 + batch)
    # policy-chosen margins spread so that beta*delta falls on both sides of the hinge at 1
    pc = rc + pr - rr + torch.linspace(-2.0, 3.0, batch, dtype=torch.float64) / beta
    ours, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="hinge")
    theirs, _, _ = TT.RSOLoss(gamma=beta)(pc, pr, rc, rr)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    assert (ours == 0).any() and (ours > 0).any()
