"""`lmforge generate`: from a checkpoint on disk to printed completions and generations.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.cli.main import main
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


def test_an_int8_kv_cache_is_chosen_by_kv_cache_dtype_and_a_bad_one_is_one_line_naming_the_key(checkpoint, capsys):
    def tokens(kind: str) -> list[list[int]]:
        recipe = GenerateRecipe(checkpoint=str(checkpoint), prompts=["To be, or", "The king"], max_new_tokens=6,
                                temperature=0.0, kv_cache_dtype=kind)
        return [r["tokens"] for r in run_generate(recipe)]

    assert tokens("int8") == tokens("auto")  # the random model's greedy margins outlast int8's rounding
    capsys.readouterr()
    assert main(["generate", f"checkpoint={checkpoint}", "kv_cache_dtype=int3", "max_new_tokens=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_cache_dtype" in err[0] and "int3" in err[0] and "int4" in err[0]


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


@pytest.fixture(scope="module")
def turn_ender(tmp_path_factory, small_tokenizer_dir):
    """A model that answers every context with <|im_end|>: its final LayerNorm's gain is zero and
    its bias a unit vector, so the head sees the same hidden state at every position, and only
    <|im_end|>'s row of the head points along it (logit 10 against 0 for every other token)."""
    from lmforge.data.tokenizer import Tokenizer

    im_end = Tokenizer.load(small_tokenizer_dir).token_to_id("<|im_end|>")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=4, max_seq_len=128,
                                    norm="layernorm", tie_embeddings=False))
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[im_end, 0] = 10.0
    directory = tmp_path_factory.mktemp("turn_ender")
    write_model_files(directory, model, small_tokenizer_dir)
    write_checksums(directory)
    return directory, im_end


def test_chat_mode_applies_the_template_and_stops_at_the_end_of_the_turn(turn_ender, small_tokenizer_dir):
    from lmforge.data.chat import chat_prompt_ids
    from lmforge.data.tokenizer import Tokenizer

    ckpt, im_end = turn_ender
    base = dict(checkpoint=str(ckpt), prompts=["What is 2 + 2?"], max_new_tokens=6, temperature=0.0)
    (plain,) = run_generate(GenerateRecipe(**base))  # not chat: <|im_end|> is just another token
    assert plain["tokens"] == [im_end] * 6 and plain["finish_reason"] == "length"
    (chat,) = run_generate(GenerateRecipe(**base, chat=True, system="Answer briefly."))
    assert chat["tokens"] == [] and chat["finish_reason"] == "stop"
    tok = Tokenizer.load(small_tokenizer_dir)
    expected = chat_prompt_ids(tok, [{"role": "system", "content": "Answer briefly."},
                                     {"role": "user", "content": "What is 2 + 2?"}])
    assert tok.decode(expected[1:]) == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_mode_reads_conversations_from_a_messages_file(turn_ender, tmp_path, capsys):
    ckpt, _ = turn_ender
    convs = tmp_path / "conversations.jsonl"
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello"},
                                                {"role": "user", "content": "Bye"}]}) + "\n")
    records = run_generate(GenerateRecipe(checkpoint=str(ckpt), messages_file=str(convs), max_new_tokens=4, temperature=0.0))
    assert [r["prompt"] for r in records] == [f"{convs}:1", f"{convs}:2"]
    assert all(r["finish_reason"] == "stop" for r in records)
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}) + "\n")
    assert main(["generate", f"checkpoint={ckpt}", f"messages_file={convs}"]) == 2
    assert f"{convs}:1: the conversation must end with a user turn" in capsys.readouterr().err


def test_chat_mode_refuses_a_tokenizer_without_im_end(checkpoint, capsys, monkeypatch):
    from lmforge.data.tokenizer import Tokenizer

    real = Tokenizer.token_to_id
    monkeypatch.setattr(Tokenizer, "token_to_id", lambda self, t: None if t == "<|im_end|>" else real(self, t))
    assert main(["generate", f"checkpoint={checkpoint}", "chat=true", "--prompt", "Hi"]) == 2
    assert "chat mode needs a tokenizer with <|im_end|>" in capsys.readouterr().err
