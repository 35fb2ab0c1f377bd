"""Serve a checkpoint over HTTP with OpenAI's API, and a chat page at the root URL.

Endpoints: GET /v1/models, POST /v1/chat/completions (the ChatML template, stops at
<|im_end|>), POST /v1/completions (text or token-id prompts; echo + logprobs scores a text,
as lm-evaluation-harness's local-completions model asks), both with stream: true as
server-sent events; POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's), GET
/health. Requests decode together in the engine's continuous batch (max_batch rows); past
max_pending requests held at once a new one gets 429. Binds to 127.0.0.1 unless host says
otherwise; port=0 (or --port 0) takes a free port. The first line printed is the URL.
With api_key set (or --api-key, or the LMFORGE_API_KEY environment variable) the API needs
the header `Authorization: Bearer <key>`; an empty key is refused at startup (it would let in
an empty Bearer key), so leave it out to serve without one. A client holds little: a body past
max_body_bytes gets 413, one not sent within body_timeout_s 408; a connection that sends no
whole request head within head_timeout_s is closed; past max_connections a request gets 503.

  lmforge serve checkpoint=runs/demo/sft --port 0
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "runs/demo/sft", "messages": [{"role": "user", "content": "What is 12 + 30?"}]}'
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model
from lmforge.core.config import in_range, load_config, option, positive
from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Engine
from lmforge.model.kv_cache import KV_CACHE_DTYPE_HELP, KVCacheDtype

try:
    from lmforge.serve.app import Served, create_app
    from lmforge.serve.server import bind, url_of, uvicorn_server
    from lmforge.serve.worker import EngineWorker
except ModuleNotFoundError as exc:  # fastapi, uvicorn, sse-starlette
    raise ModuleNotFoundError(f"lmforge serve needs the serve extra: pip install 'lmforge[serve]' ({exc})") from exc

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ServeRecipe:
    checkpoint: str = option(
        "runs/demo/sft", help="a checkpoint directory, or a run directory (its newest valid checkpoint)"
    )
    host: str = option("127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    port: int = in_range(8000, 0, 65535, help="0 = a free port, printed")
    model_name: str | None = option(None, help="the model id clients send; null = the checkpoint as given")
    api_key: str | None = option(
        None, help="clients must send 'Authorization: Bearer <key>'; null = LMFORGE_API_KEY or none; empty is refused"
    )
    max_batch: int = positive(16, help="rows decoding together in the engine's batch")
    max_pending: int = positive(64, help="requests held at once (decoding or waiting); one more gets 429")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the model's weights and compute")
    kv_cache_dtype: KVCacheDtype = option("auto", help=KV_CACHE_DTYPE_HELP)
    device: str = option("auto", help="auto = cuda when available, else cpu")
    log_level: Literal["warning", "info", "debug"] = option("info", help="the server's log level")
    max_body_bytes: int = in_range(
        2 * 2**20,
        1024,
        2**30,
        help="a larger request body gets 413 before it is read; 2 MiB of JSON parses in tens of ms on the event loop",
    )
    body_timeout_s: float = in_range(30.0, 0, 3600, low_open=True, help="a body not all sent by then gets 408")
    head_timeout_s: float = in_range(
        10.0, 0, 3600, low_open=True, help="a connection with no whole request head is closed"
    )
    max_connections: int = in_range(256, 1, 65536, help="connections open at once; past it a request gets 503")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")
    parser.add_argument("--host", help="address to listen on (recipe key host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (recipe key port; 0 = a free one, printed)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer <key>' (recipe key api_key; "
                                          "leave it out to serve without a key: an empty one is refused)")


def recipe_from_args(args: argparse.Namespace) -> ServeRecipe:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        recipe, overrides = None, [recipe, *overrides]
    cfg = load_config(ServeRecipe, recipe, overrides)
    flags = {"host": args.host, "port": args.port, "api_key": args.api_key}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    if not 0 <= cfg.port <= 65535:
        raise InputError(f"--port {cfg.port}: must be in [0, 65535]")
    return cfg


def api_key_of(recipe: ServeRecipe) -> str | None:
    """The key clients must send: the recipe's (or --api-key's), else LMFORGE_API_KEY's, else None.
    An empty or blank one is an error, not "no key": the flag was given, so a key was meant."""
    key, source = recipe.api_key, "--api-key (recipe key api_key)"
    if key is None:
        key, source = os.environ.get("LMFORGE_API_KEY"), "LMFORGE_API_KEY"
    if key is not None and not key.strip():
        raise InputError(f"{source} is empty: give a key, or leave it out (unset) to serve without one")
    if key is not None and key != key.strip():
        raise InputError(f"{source} starts or ends with a space, which an Authorization header cannot carry: drop it")
    return key


def build_served(recipe: ServeRecipe) -> Served:
    """The model, its tokenizer and the engine's worker (not yet started) for ``create_app``."""
    api_key = api_key_of(recipe)
    model, ckpt = load_model(recipe.checkpoint, device=resolve_device(recipe.device))
    model.to(DTYPES[recipe.dtype]).eval()
    tokenizer = Tokenizer.load(ckpt)
    engine = Engine(model, tokenizer, max_batch=recipe.max_batch, kv_cache_dtype=recipe.kv_cache_dtype)
    worker = EngineWorker(engine, max_pending=recipe.max_pending)
    return Served(worker, tokenizer, recipe.model_name or recipe.checkpoint, model.cfg.max_seq_len,
                  model.cfg.vocab_size, api_key, recipe.max_body_bytes, recipe.body_timeout_s)


def run_serve(recipe: ServeRecipe) -> None:
    """Serve until interrupted (Ctrl-C)."""
    served = build_served(recipe)
    try:
        sock = bind(recipe.host, recipe.port)
    except OSError as exc:
        raise InputError(f"cannot listen on {recipe.host}:{recipe.port}: {exc.strerror or exc}") from exc
    url = url_of(sock)
    print(f"lmforge serve: {served.name!r} on {url} (chat page {url}/, API {url}/v1)", flush=True)
    log.info("serve: max_batch %d, max_pending %d, %s (KV cache %s) on %s, API key %s", recipe.max_batch,
             recipe.max_pending, recipe.dtype, recipe.kv_cache_dtype, served.worker.engine.model.embed.weight.device,
             "required" if served.api_key else "off")
    # The objects of start-up (torch, the model, the tokenizer: ~350k) out of the cyclic collector's
    # reach: a request that makes many objects (4096 turns) set off full collections over all of them,
    # which held the event loop ~200 ms; frozen, the same request holds it ~20 ms.
    gc.collect()
    gc.freeze()
    uvicorn_server(create_app(served), recipe.log_level, recipe.head_timeout_s,
                   recipe.max_connections).run(sockets=[sock])


RECIPE = ServeRecipe
run = run_serve
