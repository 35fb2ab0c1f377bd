"""Model checkpoints: checksums name only files inside the checkpoint, and weights holding NaN
or inf are refused on loading."""

from __future__ import annotations

import json

import pytest
import torch

import lmforge.checkpoints.files as checkpoint
from lmforge.checkpoints.files import read_weights, verify_checksums, write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                    max_seq_len=16))
    path = tmp_path / "ckpt"
    path.mkdir()
    write_model_files(path, model, None)
    write_checksums(path)
    return path


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "sub/../../outside.txt"])
def test_a_checksum_key_outside_the_checkpoint_is_refused_without_opening_it(ckpt, monkeypatch, name):
    (ckpt.parent / "outside.txt").write_text("not the checkpoint's")
    checksums = json.loads((ckpt / "checksums.json").read_text())
    (ckpt / "checksums.json").write_text(json.dumps({name: "0" * 64, **checksums}))
    opened = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda f: opened.append(f) or "0" * 64)
    with pytest.raises(InputError, match=r"checksums.json: names .*, a file outside the checkpoint"):
        verify_checksums(ckpt)
    assert opened == []


def test_a_checkpoint_whose_weights_hold_nan_is_refused_by_load_and_read(ckpt):
    state = read_weights(ckpt)
    state["embed.weight"][0, 0] = float("nan")
    from safetensors.torch import save_file

    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    with pytest.raises(InputError, match=r"ckpt: weights hold non-finite values \(NaN or inf\) in embed.weight"):
        load_model(ckpt)  # generate, sft and chat
    with pytest.raises(InputError, match="non-finite"):
        read_weights(ckpt)  # export
