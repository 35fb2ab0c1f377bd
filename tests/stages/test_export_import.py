"""`lmforge export` writes a folder transformers loads with identical logits; `lmforge import`
reads transformers' Llama / Mistral / Qwen2 folders into checkpoints with identical logits."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.io import InputError, atomic_directory
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.import_hf import ImportRecipe, run_import

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)


@pytest.fixture(scope="module")
def tokenizer_dir(small_tokenizer_dir) -> Path:
    return small_tokenizer_dir


@pytest.fixture(scope="module")
def vocab_size(tokenizer_dir) -> int:
    return Tokenizer.load(tokenizer_dir).vocab_size


def tiny(vocab_size: int, **fields) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64), **fields})


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values everywhere, norm gains and biases included, so a dropped or mis-mapped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.ndim == 1 and "norm" in name else 0.0
            p.copy_(base + (0.1 if p.ndim == 1 else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


def save_checkpoint(path: Path, cfg: ModelConfig, tokenizer_dir: Path | None) -> Transformer:
    model = randomize_(Transformer(cfg))
    with atomic_directory(path) as tmp:
        write_model_files(tmp, model, tokenizer_dir)
        write_checksums(tmp)
    return model


def tokens(vocab_size: int, length: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(3))


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def our_logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, tokenizer_dir, vocab_size, tie):
    cfg = tiny(vocab_size, n_kv_heads=2, tie_embeddings=tie)
    ours = save_checkpoint(tmp_path / "ckpt", cfg, tokenizer_dir)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert theirs.config.num_key_value_heads == 2 and theirs.config.tie_word_embeddings == tie
    x = tokens(vocab_size)
    torch.testing.assert_close(hf_logits(theirs, x), our_logits(ours, x), atol=1e-5, rtol=0)

    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tie)  # a tied matrix is stored once


def test_export_writes_tokenizer_and_generation_config(tmp_path, tokenizer_dir, vocab_size):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), tokenizer_dir)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))

    ours = Tokenizer.load(tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "To be, or not to be: that is the question."
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    stops = [ours.eos_id, ours.token_to_id("<|im_end|>")]  # a base model's eos first, then the end of a chat turn
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (ours.bos_id, stops, ours.pad_id)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eos_id
    assert (tmp_path / "hf" / "tokenizer_config.json").read_bytes() == (tokenizer_dir / "tokenizer_config.json").read_bytes()


def test_export_resolves_newest_valid_checkpoint_of_a_run_dir(tmp_path, tokenizer_dir, vocab_size):
    cfg = tiny(vocab_size)
    save_checkpoint(tmp_path / "run" / "checkpoints" / "step_000010", cfg, tokenizer_dir)
    newest = save_checkpoint(tmp_path / "run" / "checkpoints" / "step_000020", cfg, tokenizer_dir)
    exported = run_export(ExportRecipe(checkpoint=str(tmp_path / "run"), run_dir=str(tmp_path / "hf")))
    assert exported.name == "step_000020"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = tokens(vocab_size)
    torch.testing.assert_close(hf_logits(theirs, x), our_logits(newest, x), atol=1e-5, rtol=0)


def test_export_of_gpt2_style_model_is_a_clear_error(tmp_path, vocab_size):
    cfg = tiny(vocab_size, norm="layernorm", ffn="gelu", qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True)
    save_checkpoint(tmp_path / "ckpt", cfg, None)
    with pytest.raises(InputError, match=r"ckpt.*layernorm.*RMSNorm \+ SwiGLU"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    assert not (tmp_path / "hf").exists()


def test_export_replaces_only_an_earlier_export(tmp_path, vocab_size):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), None)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a Hugging Face model folder"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "notes")))
    with pytest.raises(InputError, match="would replace the checkpoint"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path)))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))  # an earlier export is replaced
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]




def test_export_logs_its_parameter_count_as_a_person_reads_it(tmp_path, vocab_size, caplog):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size, d_model=32, n_layers=1, ffn_hidden=64), None)
    with caplog.at_level("INFO", logger="lmforge"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    assert re.search(r"\(LlamaForCausalLM, \d+(\.\d+)?K parameters, float32\)", caplog.text), caplog.text  # not 0.0M


def test_export_into_a_folder_another_run_holds_is_refused_and_a_stale_lock_is_taken(tmp_path, vocab_size):
    """A folder holding only a run lock is empty to export (a lifecycle locks its export stage's folder
    first); a lock another process holds refuses the export, naming it; the user's files still refuse it."""
    from lmforge.core.run import LOCK_FILE, RunDirBusy
    from tests.core.test_run import hold_in_subprocess

    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), None)
    (tmp_path / "hf").mkdir()  # not made by the holder's lock, so the lock file stays when it ends
    holder = hold_in_subprocess(tmp_path / "hf")
    try:
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on "):
            run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    finally:
        holder.communicate("")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [LOCK_FILE]  # its lock, left by a finished run
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [LOCK_FILE, "config.json", "model.safetensors"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / LOCK_FILE).touch()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a Hugging Face model folder"):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "notes")))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- import


def hf_folder(path: Path, config, tokenizer_dir: Path | None = None, **save_kwargs) -> torch.nn.Module:
    """A random transformers model saved with save_pretrained (plus our tokenizer files)."""
    torch.manual_seed(0)
    model = randomize_(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
    model.save_pretrained(path, **save_kwargs)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir / name, path / name)
    return model


def small_hf_config(kind: str, vocab_size: int, **fields):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=20000.0)
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
    return classes[kind](**{**common, **fields})


@pytest.mark.parametrize(
    "kind, fields",
    [
        ("llama", {}),
        ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
        ("mistral", dict(sliding_window=None)),
        ("qwen2", dict(tie_word_embeddings=True)),
    ],
    ids=["llama", "llama-tied-mqa", "mistral", "qwen2-tied"],
)
def test_import_gives_identical_logits(tmp_path, tokenizer_dir, vocab_size, kind, fields):
    theirs = hf_folder(tmp_path / "hf", small_hf_config(kind, vocab_size, **fields), tokenizer_dir)
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))

    ours, directory = load_model(tmp_path / "ckpt")
    assert ours.cfg.qkv_bias == (kind == "qwen2")
    assert ours.cfg.tie_embeddings == fields.get("tie_word_embeddings", False)
    x = tokens(vocab_size)
    torch.testing.assert_close(our_logits(ours, x), hf_logits(theirs, x), atol=1e-5, rtol=0)
    assert Tokenizer.load(directory).vocab_size == vocab_size


def test_import_reads_sharded_safetensors(tmp_path, vocab_size):
    theirs = hf_folder(tmp_path / "hf", small_hf_config("llama", vocab_size), max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    x = tokens(vocab_size)
    torch.testing.assert_close(our_logits(ours, x), hf_logits(theirs, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, fields", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
], ids=["mistral", "qwen2"])
def test_a_sliding_window_imports_and_exports_with_identical_logits_past_it(tmp_path, vocab_size, kind, fields):
    theirs = hf_folder(tmp_path / "hf", small_hf_config(kind, vocab_size, **fields))
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert (ours.cfg.max_seq_len, ours.cfg.sliding_window) == (64, 16)
    x = tokens(vocab_size, length=48)  # three windows
    torch.testing.assert_close(our_logits(ours, x), hf_logits(theirs, x), atol=1e-5, rtol=0)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "out")))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert exported.config.sliding_window == 16
    assert getattr(exported.config, "layer_types", None) == getattr(theirs.config, "layer_types", None)
    torch.testing.assert_close(hf_logits(exported, x), hf_logits(theirs, x), atol=1e-5, rtol=0)


def test_import_of_missing_folder_names_it(tmp_path):
    with pytest.raises(InputError, match=r"nowhere: not a directory.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "nowhere"), run_dir=str(tmp_path / "ckpt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty/config.json: not found"):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "empty"), run_dir=str(tmp_path / "ckpt")))
    assert not (tmp_path / "ckpt").exists()


def test_import_of_unsupported_architecture_names_what_is_supported(tmp_path):
    config = transformers.BloomConfig(vocab_size=300, hidden_size=64, n_layer=1, n_head=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bloom")
    with pytest.raises(InputError, match=r"bloom/config.json: model_type 'bloom'.*not supported.*LlamaForCausalLM.*GPT2LMHeadModel"):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "bloom"), run_dir=str(tmp_path / "ckpt")))
    assert not (tmp_path / "ckpt").exists()


def test_import_without_safetensors_weights_is_a_clear_error(tmp_path, vocab_size):
    hf_folder(tmp_path / "hf", small_hf_config("llama", vocab_size))
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no weights found"):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_import_of_llama3_rope_scaling_gives_identical_logits(tmp_path, vocab_size):
    config = small_hf_config("llama", vocab_size, max_position_embeddings=256, rope_scaling=dict(LLAMA3_ROPE))
    theirs = hf_folder(tmp_path / "hf", config)
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert (ours.cfg.rope_scaling, ours.cfg.rope_factor, ours.cfg.rope_original_max_seq_len) == ("llama3", 8.0, 64)
    x = tokens(vocab_size, length=200)  # far past the original 64 positions
    torch.testing.assert_close(our_logits(ours, x), hf_logits(theirs, x), atol=1e-5, rtol=0)


def test_export_of_llama3_rope_scaling_loads_in_transformers_with_identical_logits(tmp_path, vocab_size):
    cfg = tiny(vocab_size, n_kv_heads=2, max_seq_len=256, rope_theta=50000.0, rope_scaling="llama3", rope_factor=8.0,
               rope_original_max_seq_len=64)
    ours = save_checkpoint(tmp_path / "ckpt", cfg, None)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert theirs.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 50000.0}
    x = tokens(vocab_size, length=200)
    torch.testing.assert_close(hf_logits(theirs, x), our_logits(ours, x), atol=1e-5, rtol=0)
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "back")))
    assert load_model(tmp_path / "back")[0].cfg == cfg


def test_import_of_unsupported_rope_scaling_names_the_type(tmp_path, vocab_size):
    rope = {"rope_type": "proportional", "rope_theta": 20000.0}
    hf_folder(tmp_path / "hf", small_hf_config("llama", vocab_size, rope_scaling=rope))
    with pytest.raises(InputError, match=r"hf/config.json: RoPE scaling 'proportional' is not supported"):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    assert not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------- CLI


def test_cli_export_then_import_round_trips(tmp_path, tokenizer_dir, vocab_size, capsys):
    cfg = tiny(vocab_size, n_kv_heads=1, tie_embeddings=True)
    original = save_checkpoint(tmp_path / "ckpt", cfg, tokenizer_dir)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0

    back, _ = load_model(tmp_path / "back")
    assert back.cfg == cfg
    x = tokens(vocab_size)
    torch.testing.assert_close(our_logits(back, x), our_logits(original, x), atol=0, rtol=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tokenizer_dir / name).read_bytes()


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    assert main(["import", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("lmforge import: error:") and "nowhere" in err[0]
    assert err[1].startswith("lmforge export: error:") and "nowhere" in err[1]


def test_cli_export_casts_with_a_dtype_override(tmp_path, tokenizer_dir, vocab_size):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), tokenizer_dir)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "dtype=bfloat16"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert theirs.dtype == torch.bfloat16


# --------------------------------------------------------------------------- chat models


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The shared tokenizer with the ChatML template, as a fine-tuning run's tokenizer/ holds it."""
    from lmforge.data.chat import add_chat_template

    path = tmp_path_factory.mktemp("chat_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, path / name)
    add_chat_template(path)
    return path


class ForceTokens(transformers.LogitsProcessor):
    """Makes greedy decoding emit ``tokens`` in order, whatever the model's logits."""

    def __init__(self, tokens: list[int], prompt_length: int):
        self.tokens, self.prompt_length = tokens, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


def test_chat_export_stops_generation_at_the_end_of_the_turn(tmp_path, chat_tokenizer_dir, vocab_size):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), chat_tokenizer_dir)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))

    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    im_end, end_of_text = hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|end_of_text|>")
    assert hf_tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == [im_end, end_of_text]
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert hf_tok.decode(prompt[0]).endswith("<|im_start|>assistant\n")
    answer = hf_tok.encode("5", add_special_tokens=False)
    # the answer, the end of the turn, then what a model that does not stop writes: a new turn
    forced = answer + [im_end] + hf_tok.encode("\n<|im_start|>user\n7", add_special_tokens=False) * 4
    out = model.generate(prompt, do_sample=False, max_new_tokens=12,
                         logits_processor=transformers.LogitsProcessorList([ForceTokens(forced, prompt.shape[1])]))
    assert out[0, prompt.shape[1]:].tolist() == answer + [im_end]


def test_chat_export_keeps_end_of_text_as_a_stop_token(tmp_path, chat_tokenizer_dir, vocab_size):
    save_checkpoint(tmp_path / "ckpt", tiny(vocab_size), chat_tokenizer_dir)
    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "hf")))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = Tokenizer.load(chat_tokenizer_dir)
    forced = [7, ours.eos_id] + [9] * 10
    prompt = torch.tensor([[ours.bos_id, 5]])
    out = model.generate(prompt, do_sample=False, max_new_tokens=8,
                         logits_processor=transformers.LogitsProcessorList([ForceTokens(forced, 2)]))
    assert out[0, 2:].tolist() == [7, ours.eos_id]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == ours.token_to_id("<|im_end|>")  # the tokenizer's eos, as transformers' own exports


def test_export_merge_lora_keeps_the_chat_template(tmp_path, tokenizer_dir, vocab_size):
    from lmforge.data.chatml import CHATML_TEMPLATE
    from lmforge.peft.adapters import save_adapter
    from lmforge.peft.lora import LoraConfig, apply_lora

    cfg = tiny(vocab_size)
    save_checkpoint(tmp_path / "base", cfg, tokenizer_dir)  # a pre-trained base: no chat_template
    tuned, _ = load_model(tmp_path / "base")
    lora = LoraConfig(r=4, alpha=8)
    apply_lora(tuned, lora)
    save_adapter(tuned, lora, tmp_path / "adapter")
    assert main(["export", str(tmp_path / "base"), str(tmp_path / "hf"), "--merge-lora", str(tmp_path / "adapter")]) == 0

    exported = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert exported["chat_template"] == CHATML_TEMPLATE and exported["eos_token"] == "<|im_end|>"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [hf_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|end_of_text|>")]
    assert "chat_template" not in json.loads((tokenizer_dir / "tokenizer_config.json").read_text())  # the base is untouched


@pytest.mark.parametrize("model_type, config_class", [
    ("bloom", "BloomConfig"), ("gpt_neox", "GPTNeoXConfig"), ("falcon", "FalconConfig"), ("qwen2_moe", "Qwen2MoeConfig"),
])
def test_cli_import_of_an_unsupported_model_type_is_one_line_exit_2_nothing_written(tmp_path, capsys, model_type, config_class):
    from lmforge.model.hf import SUPPORTED_ARCHITECTURES

    (tmp_path / "hf").mkdir()
    config = getattr(transformers, config_class)().to_dict()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmforge import: error: {tmp_path / 'hf' / 'config.json'}: model_type {model_type!r}")
    assert all(f"{cls} (model_type {t!r})" in err[0] for t, cls in SUPPORTED_ARCHITECTURES.items())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("patch, named", [
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "RoPE scaling 'proportional' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "key 'attn_logit_softcapping' = 50.0 is not one lmforge knows"),
], ids=["rope-type", "refused-key", "unknown-key"])
def test_cli_import_of_a_key_lmforge_cannot_honour_is_one_line_exit_2_nothing_written(tmp_path, capsys, vocab_size, patch, named):
    hf_folder(tmp_path / "hf", small_hf_config("llama", vocab_size))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **patch}))
    capsys.readouterr()  # transformers' progress bars
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmforge import: error: {tmp_path / 'hf' / 'config.json'}: ") and named in err[0]
    assert not (tmp_path / "out").exists()
