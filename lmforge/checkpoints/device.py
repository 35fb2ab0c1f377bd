"""The device a verb runs on, from its recipe's ``device`` (``auto | cpu | cuda | cuda:N``)."""

from __future__ import annotations

import torch

from lmforge.core.io import InputError


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU if there is one, else the CPU; a GPU asked for must be there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InputError(f"device {name!r} is not a device (use auto, cpu, cuda or cuda:N): {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {name!r}: this PyTorch ({torch.__version__}) sees no CUDA GPU; use device=auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device
