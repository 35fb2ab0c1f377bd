"""The device a verb runs on: a GPU asked for must be there, a name must be a device."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.core.io import InputError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_asking_for_a_gpu_on_a_machine_without_one_is_a_clear_error():
    with pytest.raises(InputError, match="sees no CUDA GPU; use device=auto or cpu"):
        resolve_device("cuda")
    with pytest.raises(InputError, match="is not a device"):
        resolve_device("gpu0")
