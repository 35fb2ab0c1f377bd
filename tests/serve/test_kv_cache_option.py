"""`lmforge serve kv_cache_dtype=...`: the engine behind the server decodes into the chosen cache,
kept when a failed step rebuilds the engine, and a bad value is one line naming the key."""

from __future__ import annotations

import torch

from lmforge.cli.main import main
from lmforge.inference.engine import GenerationConfig, Request
from lmforge.model.kv_cache import Int4KVCache
from lmforge.stages.serve import ServeRecipe, build_served


def test_the_served_engine_decodes_into_the_chosen_cache_and_keeps_it_after_a_failed_step(checkpoint, monkeypatch):
    served = build_served(ServeRecipe(checkpoint=str(checkpoint), device="cpu", kv_cache_dtype="int4"))
    engine = served.worker.engine
    engine.submit(Request([0, 5, 9], GenerationConfig(max_new_tokens=3, temperature=0.0)))
    with torch.inference_mode():
        engine.step()
    assert isinstance(engine.batch.cache, Int4KVCache)

    def broken():
        raise RuntimeError("a step failed")

    monkeypatch.setattr(engine, "step", broken)
    served.worker.step()  # the worker fails the step's requests and builds a fresh engine
    assert served.worker.engine is not engine and served.worker.engine.kv_cache_dtype == "int4"


def test_a_bad_kv_cache_dtype_is_one_line_naming_the_key(checkpoint, capsys):
    assert main(["serve", f"checkpoint={checkpoint}", "kv_cache_dtype=q8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'kv_cache_dtype'" in err[0] and "'q8'" in err[0]
