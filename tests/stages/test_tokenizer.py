import pytest

from lmforge.core.config import load_config
from lmforge.core.io import InputError
from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer
from tests.conftest import write_jsonl


def recipe(tmp_path, corpus, *overrides) -> TokenizerRecipe:
    return load_config(TokenizerRecipe, None, [f"run_dir={tmp_path / 'tok'}", f"data.paths=[{corpus}]",
                                               "tokenizer.vocab_size=300", *overrides])


def test_a_failed_command_leaves_an_existing_tokenizers_config(tmp_path, corpus_jsonl):
    run_tokenizer(recipe(tmp_path, corpus_jsonl))
    config = (tmp_path / "tok" / "config.yaml").read_text()
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(InputError, match="no training documents"):
        run_tokenizer(recipe(tmp_path, empty, "tokenizer.vocab_size=400"))
    assert (tmp_path / "tok" / "config.yaml").read_text() == config


def test_a_rerun_that_trains_again_records_its_config_with_the_tokenizer(tmp_path, corpus_jsonl):
    run_tokenizer(recipe(tmp_path, corpus_jsonl))
    run_tokenizer(recipe(tmp_path, corpus_jsonl, "tokenizer.vocab_size=320"))
    assert "vocab_size: 320" in (tmp_path / "tok" / "config.yaml").read_text()
