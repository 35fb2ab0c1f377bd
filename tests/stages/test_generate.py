"""`lmforge generate`: from a checkpoint on disk to printed completions and generations.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli.main import main
from lmforge.model.checkpoint import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.stages.generate import GenerateRecipe, run_generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_tokenizer_dir):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128))
    directory = tmp_path_factory.mktemp("ckpt")
    write_model_files(directory, model, small_tokenizer_dir)
    write_checksums(directory)
    return directory


def test_cli_prints_each_prompt_with_its_completion(checkpoint, capsys):
    code = main(["generate", f"checkpoint={checkpoint}", 'prompts=["To be, or", "The king"]', "max_new_tokens=8", "temperature=0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "[1/2]" in out and "[2/2]" in out
    assert "\nTo be, or" in out and "\nThe king" in out


def test_prompt_flag_replaces_the_recipe_prompts(checkpoint, capsys):
    assert main(["generate", "--prompt", "Hello there", f"checkpoint={checkpoint}", "max_new_tokens=4"]) == 0
    out = capsys.readouterr().out
    assert "\nHello there" in out and "[1/1]" in out


def test_run_dir_receives_generations_jsonl(checkpoint, tmp_path):
    recipe = GenerateRecipe(checkpoint=str(checkpoint), prompts=["a", "bb cc"], max_new_tokens=5, temperature=0.0,
                            run_dir=str(tmp_path / "gen"))
    records = run_generate(recipe)
    lines = [json.loads(line) for line in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    assert lines == records
    assert [r["prompt"] for r in lines] == ["a", "bb cc"]
    assert all(r["prompt_tokens"][0] == 0 and r["finish_reason"] in ("stop", "length") for r in lines)  # 0 = BOS
    assert (tmp_path / "gen" / "config.yaml").is_file()


def test_same_seed_gives_the_same_samples(checkpoint):
    recipe = GenerateRecipe(checkpoint=str(checkpoint), prompts=["To be"], max_new_tokens=12, seed=5)
    assert run_generate(recipe) == run_generate(recipe)


def test_bfloat16_and_no_bos_run(checkpoint):
    recipe = GenerateRecipe(checkpoint=str(checkpoint), prompts=["To be"], max_new_tokens=4, dtype="bfloat16",
                            add_bos=False, temperature=0.0)
    (record,) = run_generate(recipe)
    assert record["prompt_tokens"][0] != 0 and len(record["tokens"]) <= 4


def test_missing_checkpoint_exits_2_with_a_clear_message(tmp_path, capsys):
    assert main(["generate", f"checkpoint={tmp_path / 'nope'}", "max_new_tokens=4"]) == 2
    err = capsys.readouterr().err
    assert "lmforge generate: error:" in err and "nope" in err and "not a checkpoint" in err


def test_prompt_longer_than_the_context_exits_2(checkpoint, capsys):
    assert main(["generate", f"checkpoint={checkpoint}", "max_new_tokens=200", "--prompt", "hi"]) == 2
    assert "max_seq_len 128" in capsys.readouterr().err


def test_stop_token_ids_end_a_completion_at_the_first_one(checkpoint, capsys):
    base = dict(checkpoint=str(checkpoint), prompts=["To be"], max_new_tokens=12, temperature=0.0)
    (free,) = run_generate(GenerateRecipe(**base, stop_token_ids=[]))
    assert free["finish_reason"] == "length" and len(free["tokens"]) == 12
    stop_at = free["tokens"][5]
    first = free["tokens"].index(stop_at)
    (stopped,) = run_generate(GenerateRecipe(**base, stop_token_ids=[stop_at]))
    assert stopped["finish_reason"] == "stop" and stopped["tokens"] == free["tokens"][:first]
    code = main(["generate", f"checkpoint={checkpoint}", "stop_token_ids=[100000]", "max_new_tokens=2"])
    assert code == 2 and "outside the vocabulary" in capsys.readouterr().err
