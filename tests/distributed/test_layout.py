"""Impossible layouts are errors before any work starts, and say what to change."""

from __future__ import annotations

import pytest

from lmforge.cli.main import main
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import Layout, LayoutError, check_layout, resolve_layout, stage_layer_ranges
from lmforge.model.config import ModelConfig
from lmforge.stages.pretrain import run_pretrain

MODEL = ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128)


def test_dp_shard_minus_one_fills_the_world():
    assert resolve_layout(ParallelConfig(tp=2), 8) == Layout(dp_replicate=1, dp_shard=4, tp=2, pp=1)
    assert resolve_layout(ParallelConfig(), 1) == Layout()


def test_world_size_must_equal_the_product_of_the_mesh():
    with pytest.raises(LayoutError, match=r"= 8 processes, but the world size is 4; set parallel.dp_shard=-1"):
        resolve_layout(ParallelConfig(dp_shard=2, tp=2, pp=2), 4)
    with pytest.raises(LayoutError, match="world size 6 is not divisible by dp_replicate x tp x pp = 4"):
        resolve_layout(ParallelConfig(tp=2, pp=2), 6)


@pytest.mark.parametrize("parallel,micro_batch,message", [
    (ParallelConfig(tp=3), 4, r"model.n_heads=4 is not divisible by parallel.tp=3"),
    (ParallelConfig(tp=4), 4, r"model.n_kv_heads=2 is not divisible by parallel.tp=4"),
    (ParallelConfig(pp=4), 4, r"model.n_layers=4 cannot be split into parallel.pp=4 .* n_layers = 6"),
    (ParallelConfig(pp=2, pp_microbatches=1), 4, r"pp_microbatches=1 is fewer than the 2 pipeline stages"),
    (ParallelConfig(pp=2, pp_microbatches=3), 4, r"micro_batch_size=4 is not divisible by parallel.pp_microbatches=3"),
])
def test_impossible_layouts_say_what_to_change(parallel, micro_batch, message):
    layout = resolve_layout(parallel, parallel.tp * parallel.pp)
    with pytest.raises(LayoutError, match=message):
        check_layout(layout, parallel, MODEL, micro_batch)


def test_tied_embeddings_cannot_be_split_across_pipeline_stages():
    tied = ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, ffn_hidden=128, tie_embeddings=True)
    with pytest.raises(LayoutError, match="tie_embeddings=false or parallel.pp=1"):
        check_layout(Layout(pp=2), ParallelConfig(pp=2), tied, 4)


def test_every_problem_is_listed_at_once():
    with pytest.raises(LayoutError) as exc:
        check_layout(Layout(tp=3, pp=4), ParallelConfig(tp=3, pp=4), MODEL, 4)
    assert "n_heads" in str(exc.value) and "n_layers" in str(exc.value)


def test_stages_balance_layers_with_the_embedding_and_head_as_a_layer_each():
    assert [len(r) for r in stage_layer_ranges(126, 16)] == [7] + [8] * 14 + [7]  # Llama 3 405B
    assert stage_layer_ranges(2, 2) == [range(0, 1), range(1, 2)]
    assert stage_layer_ranges(6, 1) == [range(6)]


def test_pretrain_refuses_a_layout_before_any_work(make_recipe, tmp_path):
    recipe = make_recipe(tmp_path / "run", **{"parallel.tp": 2})  # one process cannot hold tp=2
    with pytest.raises(LayoutError, match="world size 1 is not divisible by dp_replicate x tp x pp = 2"):
        run_pretrain(recipe)
    assert not (tmp_path / "run").exists()


def test_cli_reports_a_bad_layout_in_one_line_and_lists_parallel_keys(capsys):
    assert main(["pretrain", "parallel.tp=2", "model.n_heads=3", "model.d_model=48"]) == 2
    err = capsys.readouterr().err
    assert "lmforge pretrain: error: parallel" in err and "world size 1" in err
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = capsys.readouterr().out
    for key in ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp", "parallel.pp_schedule",
                "parallel.pp_microbatches", "parallel.reshard_after_forward", "parallel.async_checkpoint"):
        assert key in out


def test_tensor_parallelism_refuses_an_alibi_model_before_touching_a_mesh():
    from types import SimpleNamespace

    from lmforge.core.config import ConfigError
    from lmforge.distributed.parallelize import parallelize_model
    from lmforge.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16, positions="alibi"))
    ctx = SimpleNamespace(layout=SimpleNamespace(tp=2, pp=1, dp=1), cfg=SimpleNamespace(), tp_mesh=None)
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 with model.positions = alibi"):
        parallelize_model(model, ctx, precision="fp32", activation_checkpointing=False, compile=False)
