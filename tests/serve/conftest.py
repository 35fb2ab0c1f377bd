"""Fixtures of the server tests: a tiny checkpoint with the shared tokenizer, served in this
process on a free 127.0.0.1 port, and the official ``openai`` client pointed at it."""

from __future__ import annotations

import os

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, small_tokenizer_dir):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=1024)).eval()
    path = tmp_path_factory.mktemp("serve-ckpt")
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


def start_server(checkpoint, **recipe):
    from lmforge.serve.app import create_app
    from lmforge.serve.server import BackgroundServer
    from lmforge.stages.serve import ServeRecipe, build_served

    cfg = ServeRecipe(checkpoint=str(checkpoint), model_name=MODEL_NAME, device="cpu", **recipe)
    served = build_served(cfg)
    background = BackgroundServer(create_app(served), head_timeout_s=cfg.head_timeout_s,
                                  max_connections=cfg.max_connections)
    return background.start(), served


@pytest.fixture(scope="module")
def server(checkpoint):
    background, served = start_server(checkpoint, max_batch=8)
    yield background, served
    background.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_and_tokenizer(server):
    served = server[1]
    return served.worker.engine.model, served.tokenizer
