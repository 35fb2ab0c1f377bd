"""The GPT-2 family (``lmforge.model.families.gpt2``): its variants for tests/model/test_parity.py;
every config.json key of transformers' GPT2Config honoured (equal logits), refused (one line) or
inert; import and export through the stages with GPT2LMHeadModel's logits; training, LoRA,
checkpoints, FSDP and tensor parallelism; and nanoGPT's shakespeare_char recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.core.io import InputError, atomic_directory
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.config import ROPE_SCALING_KEYS, ModelConfig
from lmforge.model.families import build, model_config
from lmforge.model.families.gpt2 import GPT2, GPT2Config
from lmforge.model.families.gpt2.hf import TANH_GELUS
from lmforge.model.hf import hf_config_dict, model_config_from_hf, state_dict_to_hf
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules, merge_lora
from lmforge.stages.import_hf import ImportRecipe, run_import
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer
from lmforge.train.metrics import read_metrics
from tests.conftest import REPO
from tests.model.families.hf_keys import HfKeys, from_folder
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (a fixture of tests/train)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

# --------------------------------------------------------------------------- tests/model/test_parity.py

_SLIDING_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
PARITY_VARIANTS = {
    "gpt2:mup": dict(family="gpt2", mup={"base_width": 16, "base_head_dim": 4}),  # µP: the readout multiplier in LayerNorm's gain and bias
    "gpt2:plain": dict(family="gpt2", ffn_hidden=None),  # GPT-2's parts and its MLP, 4 d_model wide
    "gpt2:untied": dict(family="gpt2", tie_embeddings=False, norm_eps=1e-6),
    "gpt2:no-biases": dict(family="gpt2", qkv_bias=False, out_bias=False, mlp_bias=False),  # exported as zero biases
    # the shared parts' options on learned positions, which GPT2LMHeadModel has not (PARITY_HF_REFUSED)
    "gpt2:gqa-qk-norm": dict(family="gpt2", n_kv_heads=2, head_dim=32, qk_norm=True),
    "gpt2:rmsnorm-swiglu": dict(family="gpt2", norm="rmsnorm", ffn="swiglu"),
    "gpt2:sliding-window": dict(family="gpt2", sliding_window=6),  # every layer: the cache is a ring of 6
    "gpt2:sliding-layers": dict(family="gpt2", sliding_window=5, layer_types=_SLIDING_LAYERS),
}
# variant -> what the one-line ValueError of its Hugging Face export names
PARITY_HF_REFUSED = {
    "gpt2:gqa-qk-norm": "n_kv_heads = 2",
    "gpt2:rmsnorm-swiglu": "norm 'rmsnorm'",
    "gpt2:sliding-window": "sliding_window = 6",
    "gpt2:sliding-layers": "sliding_window = 5",
}
# family -> its config's fields that no variant changes, and why
PARITY_NOT_ARITHMETIC = {"gpt2": {
    "positions": "always learned: GPT2Config refuses others (test_positions_other_than_learned_are_refused)",
    **dict.fromkeys(("rope_scaling", *ROPE_SCALING_KEYS), "RoPE's: the gpt2 family has learned positions"),
}}


def tiny(**fields) -> GPT2Config:
    return GPT2Config(**{"vocab_size": 300, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, **fields})


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values everywhere, norm gains and biases included, so a dropped or mis-mapped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.ndim == 1 and ("norm" in name or "ln" in name) and name.endswith("weight") else 0.0
            p.copy_(base + (0.1 if p.ndim == 1 else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return (logits(a) - logits(b)).abs().max().item()


# --------------------------------------------------------------------------- the config and the model


def test_gpt2_config_has_gpt2s_parts_by_default():
    cfg = model_config({"family": "gpt2", "d_model": 64, "n_heads": 4})
    assert type(cfg) is GPT2Config and type(build(cfg)) is GPT2
    assert (cfg.positions, cfg.norm, cfg.ffn, cfg.ffn_hidden) == ("learned", "layernorm", "gelu", 256)
    assert cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias and cfg.tie_embeddings
    assert build(cfg).pos_embed.weight.shape == (cfg.max_seq_len, 64)


def test_the_gpt2_124m_preset_is_gpt2_small():
    cfg = ModelConfig.from_preset("gpt2-124m")
    assert type(cfg) is GPT2Config
    with torch.device("meta"):
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config())  # openai-community/gpt2's shape
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters()) == 124_439_808
    assert model_config_from_hf(transformers.GPT2Config().to_dict()) == GPT2Config(
        **{**ModelConfig.expand_preset({"preset": "gpt2-124m"}), "preset": None},
        embed_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1)  # transformers' default dropout


def test_positions_other_than_learned_are_refused():
    for positions in ("rope", "alibi"):
        with pytest.raises(ValueError, match=rf"^positions '{positions}': the gpt2 family has learned absolute "
                                             r"positions; a RoPE or ALiBi model .* is family llama") as info:
            tiny(positions=positions)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="positions 'rope'"):
        load_config(PretrainRecipe, None, ["model.family=gpt2", "model.positions=rope"])


def test_export_names_every_part_gpt2lmheadmodel_lacks_in_one_line():
    with pytest.raises(ValueError) as info:
        hf_config_dict(tiny(n_kv_heads=1, qk_norm=True, ffn="swiglu"))
    message = str(info.value)
    assert message.startswith("GPT2LMHeadModel cannot compute this model: n_kv_heads = 1")
    assert "qk_norm" in message and "ffn 'swiglu'" in message and "\n" not in message


def test_every_parameter_maps_to_gpt2lmheadmodels_own():
    for cfg in (tiny(), tiny(tie_embeddings=False)):
        theirs = transformers.GPT2LMHeadModel(transformers.AutoConfig.for_model(**hf_config_dict(cfg)))
        expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
        ours = {k: tuple(v.shape) for k, v in state_dict_to_hf(build(cfg).state_dict(), cfg).items()}
        assert ours == expected


# --------------------------------------------------------------------------- config.json keys

BASE = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
# key -> (what else the pair of configs sets, the value away from transformers' default)
VARIANTS: dict[str, tuple[dict, object]] = {
    "vocab_size": ({}, 301),
    "n_embd": ({}, 96),
    "n_layer": ({}, 3),
    "n_head": ({}, 8),
    "n_positions": ({}, 128),
    "n_inner": ({}, 96),
    "layer_norm_epsilon": ({}, 0.5),
    "tie_word_embeddings": ({}, False),
    "hidden_size": ({}, 96),  # GPT2Config.attribute_map's names, written in place of GPT-2's own
    "max_position_embeddings": ({}, 128),
    "num_attention_heads": ({}, 8),
    "num_hidden_layers": ({}, 3),
    "activation_function": ({}, "gelu"),  # GELU's erf form: refused (the tanh forms: test_every_tanh_form_...)
    "embd_pdrop": ({}, 0.3),
    "attn_pdrop": ({}, 0.3),
    "resid_pdrop": ({}, 0.3),
    "scale_attn_weights": ({}, False),
    "scale_attn_by_inverse_layer_idx": ({}, True),
    "add_cross_attention": ({}, True),
    "quantization_config": ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    "pruned_heads": ({}, {"0": [1]}),
    "auto_map": ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
}
ALIAS_OF = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"}
DROPOUTS = {"embd_pdrop": "embed_dropout", "attn_pdrop": "attn_dropout", "resid_pdrop": "resid_dropout"}
# keys whose change a tiny model cannot show on its logits in eval mode, and why (or what the test checks instead)
NOT_ON_EVAL_LOGITS = {
    **dict.fromkeys(DROPOUTS, "acts in training only: the test checks transformers' train-mode logits move"),
    "quantization_config": "building a quantized model needs a quantization backend; the weights are not plain matrices",
    "pruned_heads": "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    "auto_map": "custom modelling code (trust_remote_code) computes the model; the test builds none",
}


def build_folder(path: Path, fields: dict, patch: dict) -> torch.nn.Module:
    """A random GPT2LMHeadModel of ``fields`` saved by transformers, its config.json then holding ``patch`` verbatim."""
    return HF_KEYS.build_folder(path, "gpt2", fields, patch)


@pytest.mark.parametrize("activation", ["gelu", "relu", "quick_gelu"])
def test_an_activation_other_than_geluss_tanh_form_is_refused(tmp_path, activation):
    build_folder(tmp_path / "hf", {"activation_function": activation}, {})
    with pytest.raises(InputError, match=rf"activation_function = '{activation}' is not supported .*lmforge supports "
                                         r'"gelu_new" or "gelu_pytorch_tanh"'):
        run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))


@pytest.mark.parametrize("activation", TANH_GELUS)
def test_every_tanh_form_of_gelu_imports_with_equal_logits(tmp_path, activation):
    theirs = build_folder(tmp_path / "hf", {"activation_function": activation}, {})
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    assert max_diff(load_model(tmp_path / "ckpt")[0], theirs) <= 1e-5


INERT_SAMPLES = {  # values a real config.json carries; the rest get a generic one
    "bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 7, "sep_token_id": 8, "decoder_start_token_id": 9,
    "use_cache": False, "dtype": "bfloat16", "torch_dtype": "bfloat16", "initializer_range": 0.5,
    "output_attentions": True, "output_hidden_states": True, "chunk_size_feed_forward": 4, "n_ctx": 1024,
    "reorder_and_upcast_attn": True, "summary_type": "last", "summary_use_proj": False, "summary_activation": "tanh",
    "summary_proj_to_labels": False, "summary_first_dropout": 0.5, "summary_last_dropout": 0.5,
    "transformers_version": "4.40.1",
}


# tests/model/families/test_hf_config_keys.py holds every key against transformers by this: GPT2Config's
# attribute_map names written in place of GPT-2's own, the erf GELU refused (the tanh forms honoured)
HF_KEYS = HfKeys(family="gpt2", classes={"gpt2": transformers.GPT2Config}, base={"gpt2": BASE}, variants=VARIANTS,
                 not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=GPT2, inert_samples=INERT_SAMPLES,
                 min_inert_checked=15, dropouts=DROPOUTS, partly_honoured="activation_function",
                 unknown_key=("rotary_dim", 16), randomize=randomize_, alias_of=ALIAS_OF)


# --------------------------------------------------------------------------- import and export


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_import_then_export_through_the_cli_gives_gpt2lmheadmodels_logits_and_weights(tmp_path, tie):
    theirs = build_folder(tmp_path / "hf", {"tie_word_embeddings": tie, "n_inner": 96}, {})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours, _ = load_model(tmp_path / "ckpt")
    assert type(ours) is GPT2 and ours.cfg.tie_embeddings == tie and ours.cfg.ffn_hidden == 96
    assert max_diff(ours, theirs) <= 1e-5

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    back = from_folder(tmp_path / "back")
    assert type(back).__name__ == "GPT2LMHeadModel"
    assert max_diff(back, theirs) <= 1e-5
    saved, exported = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", tmp_path / "back"))
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)


def save_checkpoint(path: Path, cfg: GPT2Config, tokenizer_dir: Path | None = None) -> GPT2:
    model = randomize_(build(cfg))
    with atomic_directory(path) as tmp:
        write_model_files(tmp, model, tokenizer_dir)
        write_checksums(tmp)
    return model


@pytest.mark.parametrize("fields", [{}, dict(tie_embeddings=False, ffn_hidden=80, norm_eps=1e-6),
                                    dict(qkv_bias=False, out_bias=False, mlp_bias=False)],
                         ids=["gpt2", "untied", "no-biases"])
def test_export_loads_as_gpt2lmheadmodel_with_identical_logits(tmp_path, small_tokenizer_dir, fields):
    cfg = tiny(vocab_size=Tokenizer.load(small_tokenizer_dir).vocab_size, **fields)
    ours = save_checkpoint(tmp_path / "ckpt", cfg, small_tokenizer_dir)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    theirs = from_folder(tmp_path / "hf")
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    assert max_diff(ours, theirs) <= 1e-5
    if not cfg.qkv_bias:  # exported as zeros, what the model computes
        assert not theirs.transformer.h[0].attn.c_attn.bias.any()
    tok = Tokenizer.load(small_tokenizer_dir)
    assert (theirs.config.bos_token_id, theirs.config.eos_token_id) == (tok.bos_id, tok.eos_id)


def test_import_reads_openai_gpt2s_own_layout(tmp_path):
    """openai-community/gpt2's folder: weights named as GPT2Model's (no ``transformer.`` prefix) with the old
    causal-mask buffers, and a config.json with n_ctx, the double-heads model's summary keys and task params."""
    theirs = build_folder(tmp_path / "built", {}, {})
    state = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    for i in range(BASE["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.ones(64, 64, dtype=torch.bool).tril().view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "hf").mkdir()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    config = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
              "bos_token_id": 0, "embd_pdrop": 0.1, "eos_token_id": 0, "initializer_range": 0.02,
              "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 64, "n_embd": 64, "n_head": 4,
              "n_layer": 2, "n_positions": 64, "resid_pdrop": 0.1, "summary_activation": None,
              "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
              "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
              "vocab_size": 300}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert max_diff(ours, theirs) <= 1e-5
    assert max_diff(ours, from_folder(tmp_path / "hf")) <= 1e-5  # transformers reads the folder alike


# --------------------------------------------------------------------------- training, LoRA, checkpoints


def gpt2_recipe(run_dir: Path, shards: Path, tokenizer: Path, **overrides) -> PretrainRecipe:
    """tests/train's tiny fp32 pre-training recipe (2 layers, width 32, vocabulary 512, 8 steps) as a GPT-2."""
    return load_config(PretrainRecipe, None, tiny_pretrain_overrides(
        run_dir, shards, tokenizer, **{"model.family": "gpt2", "model.n_kv_heads": 4, **overrides}))


def test_pretraining_lowers_the_loss_and_the_run_exports(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    summary = run_pretrain(gpt2_recipe(tmp_path / "run", shards_dir, small_tokenizer_dir, **{"train.lr": 1e-2}))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 8 and max(losses[-2:]) < losses[0] - 0.2, losses
    assert summary["val_loss"] < summary["unigram_entropy"] + 1.0
    ours, _ = load_model(tmp_path / "run")
    assert type(ours) is GPT2
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (logits(ours, x) - logits(from_folder(tmp_path / "hf"), x)).abs().max().item() <= 1e-5


def test_lora_adapts_every_projection_and_merges_back_to_the_same_logits(tmp_path):
    model = randomize_(build(tiny()))
    base = logits(model)
    wrapped = apply_lora(model, LoraConfig(r=4, alpha=8.0))
    assert sorted(wrapped) == sorted(f"layers.{i}.{m}" for i in range(2)
                                     for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2"))
    assert torch.equal(logits(model), base)  # B starts at zero
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.05)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-2
    merge_lora(model)
    assert not lora_modules(model)
    assert (logits(model) - adapted).abs().max().item() <= 1e-5
    with atomic_directory(tmp_path / "merged") as tmp:  # the merged model exports as any other
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    assert main(["export", str(tmp_path / "merged"), str(tmp_path / "hf")]) == 0
    assert (logits(from_folder(tmp_path / "hf")) - adapted).abs().max().item() <= 1e-5


def test_a_checkpoint_saves_and_loads_the_same_gpt2(tmp_path):
    cfg = tiny(tie_embeddings=False, embed_dropout=0.1, resid_dropout=0.2)
    ours = save_checkpoint(tmp_path / "ckpt", cfg)
    assert json.loads((tmp_path / "ckpt" / "model.json").read_text())["family"] == "gpt2"
    loaded, _ = load_model(tmp_path / "ckpt")
    assert type(loaded) is GPT2 and loaded.cfg == cfg
    assert torch.equal(logits(loaded), logits(ours))
    save_checkpoint(tmp_path / "tied", tiny())
    tied, _ = load_model(tmp_path / "tied")
    assert tied.lm_head.weight is tied.embed.weight


# --------------------------------------------------------------------------- FSDP and tensor parallelism


def test_fsdp_and_tensor_parallel_runs_match_a_single_process_run(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    from tests.distributed.conftest import torchrun

    def recipe(name: str, **overrides) -> PretrainRecipe:
        return gpt2_recipe(tmp_path / name, shards_dir, small_tokenizer_dir, **{"train.max_steps": 3, **overrides})

    # GPT-2's tied head with TP: the shared matrix is split once, by vocabulary (no loss parallelism)
    runs = {"fsdp": {"parallel.dp_shard": 2}, "tp": {"parallel.tp": 2, "parallel.loss_parallel": False},
            "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.loss_parallel": False}}
    run_pretrain(recipe("reference"))
    torchrun(2, [{"kind": "pretrain", "recipe": recipe(name, **o)} for name, o in runs.items()], tmp_path)
    def curves(run: str) -> list[float]:
        return [v for r in read_metrics(tmp_path / run) if "loss" in r for v in (r["loss"], r["grad_norm"])]

    expected = curves("reference")
    assert len(expected) == 6
    for name in runs:
        assert curves(name) == pytest.approx(expected, rel=1e-5), name


# --------------------------------------------------------------------------- recipes/nanogpt


def test_the_shakespeare_char_recipe_is_nanogpts_cpu_run_and_trains(tmp_path, corpus_jsonl):
    recipes = REPO / "recipes" / "nanogpt"
    run_tokenizer(load_config(TokenizerRecipe, recipes / "tokenizer.yaml",
                              [f"run_dir={tmp_path / 'tokenizer'}", f"data.paths=[{corpus_jsonl}]"]))
    tok = Tokenizer.load(tmp_path / "tokenizer")
    line = "ROMEO: But, soft! what light through yonder window breaks?"
    assert tok.vocab_size == 261 and len(tok.encode(line)) == len(line)  # one token a character
    run_prepare(load_config(PrepareRecipe, recipes / "prepare.yaml",
                            [f"run_dir={tmp_path / 'data'}", f"tokenizer={tmp_path / 'tokenizer'}",
                             f"data.paths=[{corpus_jsonl}]"]))
    recipe = load_config(PretrainRecipe, recipes / "shakespeare_char.yaml", [
        f"run_dir={tmp_path / 'run'}", f"tokenizer={tmp_path / 'tokenizer'}",
        f"data.datasets=[{{path: {tmp_path / 'data'}}}]", "train.stop_at_step=2", "train.tensorboard=false"])
    m, t = recipe.model, recipe.train
    assert type(m) is GPT2Config and (m.n_layers, m.n_heads, m.d_model, m.max_seq_len) == (4, 4, 128, 64)
    assert (m.embed_dropout, m.attn_dropout, m.resid_dropout, recipe.data.seq_len, t.micro_batch_size) == (0, 0, 0, 64, 12)
    assert (t.lr, t.lr * t.min_lr_ratio, t.max_steps, t.warmup_steps, t.beta2) == (1e-3, pytest.approx(1e-4), 2000, 100, 0.99)
    run_pretrain(recipe)
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]
