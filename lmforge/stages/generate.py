"""Continue prompts with a trained checkpoint: greedy (temperature=0) or sampled with
temperature, top-k and top-p, stopping at end of text (or the stop_token_ids given), a stop
string or max_new_tokens.
All prompts decode together as one batch with a KV cache. Prints each prompt with its
completion; with run_dir set, also writes generations.jsonl there. checkpoint is a
checkpoint directory or a run directory (its newest valid checkpoint).

  lmforge generate --prompt "To be, or not" checkpoint=runs/demo/pretrain temperature=0
  lmforge generate checkpoint=runs/demo/pretrain prompts='["ROMEO:", "JULIET:"]' top_p=0.9 seed=1

Chat mode (a fine-tuned model): with chat=true each prompt is a user turn (after `system`, if
set), or with messages_file each JSONL line's `messages` is a conversation ending with the
user; the ChatML template is applied up to the assistant's turn and generation stops at
<|im_end|> (or end of text).

  lmforge generate checkpoint=runs/demo/sft chat=true temperature=0 --prompt "What is 12 + 30?"
  lmforge generate checkpoint=runs/demo/dpo messages_file=conversations.jsonl temperature=0
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model
from lmforge.core.config import at_least, load_config, option, positive, seed_field, unit_interval
from lmforge.core.io import InputError, atomic_write_text
from lmforge.core.run import log, record_config, run_dir_lock, start_run
from lmforge.data.chat import chat_prompt_ids, read_sft_records
from lmforge.data.chatml import IM_END, ExampleError, validate_messages
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import GenerationConfig, generate
from lmforge.model.kv_cache import KV_CACHE_DTYPE_HELP, KVCacheDtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class GenerateRecipe:
    checkpoint: str = option(
        "runs/demo/pretrain", help="a checkpoint directory, or a run directory (its newest valid checkpoint)"
    )
    prompts: list[str] = option(
        default_factory=lambda: ["To be, or not to be"], help="the texts to continue, decoded together"
    )
    max_new_tokens: int = positive(128, help="the longest completion")
    temperature: float = at_least(0, 0.8, help="0 = greedy")
    top_k: int = at_least(0, 0, help="0 = off")
    top_p: float = unit_interval(0.95, low_open=True, help="nucleus; 1 = off")
    stop: list[str] = option(default_factory=list, help="cut the completion before the first of these")
    stop_token_ids: list[int] | None = at_least(
        0, None, help="stop at any of these token ids; null = the tokenizer's end of text; [] = never early"
    )
    seed: int | None = seed_field(0, help="same seed, same prompts -> same completions; null = unseeded")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the model's weights and compute")
    kv_cache_dtype: KVCacheDtype = option("auto", help=KV_CACHE_DTYPE_HELP)
    draft_tokens: int = at_least(0, 0, help="greedy decoding drafts this many tokens a step with the model's "
                                 "multi-token prediction modules (model.mtp.depth at least this) and keeps those the model "
                                 "would choose: the same tokens, one prompt at a time; 0 = off")
    device: str = option("auto", help="auto = cuda when available, else cpu")
    add_bos: bool = option(True, help="prompt = [bos] + encode(text), as documents were in pre-training (chat: always)")
    chat: bool = option(False, help="each prompt is a user turn: ChatML template applied, stop at <|im_end|>")
    system: str | None = option(None, help="chat: a system turn before each prompt")
    messages_file: str | None = option(
        None, help='chat: JSONL of {"messages": [...]} conversations ending with the user; replaces prompts'
    )
    run_dir: str | None = option(None, help="when set, receives generations.jsonl and config.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several); replaces the recipe's prompts")


def recipe_from_args(args: argparse.Namespace) -> GenerateRecipe:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        recipe, overrides = None, [recipe, *overrides]
    cfg = load_config(GenerateRecipe, recipe, overrides)
    if args.prompt:
        cfg.prompts = list(args.prompt)
    return cfg


def conversations(recipe: GenerateRecipe) -> list[tuple[str, list[dict]]]:
    """Chat mode's conversations, each with how it is shown: the prompt text, or file:line."""
    if recipe.messages_file is None:
        system = [{"role": "system", "content": recipe.system}] if recipe.system else []
        return [(p, [*system, {"role": "user", "content": p}]) for p in recipe.prompts]
    out = []
    for where, record in read_sft_records([recipe.messages_file]):
        try:
            if isinstance(record, ExampleError):
                raise record
            if not isinstance(record, dict) or "messages" not in record:
                raise ExampleError("bad_messages", "each line must be an object with 'messages'")
            validate_messages(record["messages"], need_assistant=False)
            if record["messages"][-1]["role"] != "user":
                raise ExampleError("bad_messages", "the conversation must end with a user turn, for the model to answer")
        except ExampleError as exc:
            raise InputError(f"{where}: {exc}") from exc
        out.append((where, record["messages"]))
    return out


def encode_prompts(recipe: GenerateRecipe, tokenizer: Tokenizer) -> tuple[list[str], list[list[int]]]:
    """The prompts as shown and as token ids (ChatML up to the assistant's turn in chat mode)."""
    if recipe.chat or recipe.messages_file is not None:
        chats = conversations(recipe)
        return [shown for shown, _ in chats], [chat_prompt_ids(tokenizer, c) for _, c in chats]
    return list(recipe.prompts), [([tokenizer.bos_id] if recipe.add_bos else []) + tokenizer.encode(p)
                                  for p in recipe.prompts]


def chat_stop_ids(recipe: GenerateRecipe, tokenizer: Tokenizer) -> list[int] | None:
    """Chat mode stops at the end of the assistant's turn (and at end of text) unless
    stop_token_ids is given."""
    if not (recipe.chat or recipe.messages_file is not None) or recipe.stop_token_ids is not None:
        return list(recipe.stop_token_ids) if recipe.stop_token_ids is not None else None
    im_end = tokenizer.token_to_id(IM_END)
    if im_end is None:
        raise InputError(f"chat mode needs a tokenizer with {IM_END} (a fine-tuned checkpoint); this one has none")
    return [im_end, tokenizer.eos_id]


def run_generate(recipe: GenerateRecipe) -> list[dict]:
    """Generate a completion for every prompt; return one record per prompt (as in generations.jsonl)."""
    if not recipe.prompts and recipe.messages_file is None:
        raise InputError("prompts is empty: give at least one prompt (prompts='[\"...\"]' or --prompt TEXT)")
    model, ckpt = load_model(recipe.checkpoint, device=resolve_device(recipe.device))
    model.to(DTYPES[recipe.dtype]).eval()
    tokenizer = Tokenizer.load(ckpt)
    bad = [t for t in recipe.stop_token_ids or [] if not 0 <= t < model.cfg.vocab_size]
    if bad:
        raise InputError(f"stop_token_ids {bad} are outside the vocabulary [0, {model.cfg.vocab_size})")
    try:
        config = GenerationConfig(
            max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature, top_k=recipe.top_k,
            top_p=recipe.top_p, stop=list(recipe.stop), seed=recipe.seed,
            stop_token_ids=chat_stop_ids(recipe, tokenizer),
        )
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    prompts, prompt_ids = encode_prompts(recipe, tokenizer)
    for text, ids in zip(prompts, prompt_ids):
        if not ids:
            raise InputError(f"prompt {text!r} encodes to no tokens; give some text or set add_bos=true")

    t0 = time.perf_counter()
    try:
        results = generate(model, prompt_ids, config, tokenizer, kv_cache_dtype=recipe.kv_cache_dtype,
                           draft_tokens=recipe.draft_tokens)
    except ValueError as exc:  # e.g. prompt + max_new_tokens longer than the model's context
        raise InputError(str(exc)) from exc
    seconds = time.perf_counter() - t0
    n_new = sum(len(r.tokens) for r in results)
    log.info("generate: %d tokens for %d prompts in %.2fs (%.1f tokens/s, %s, KV cache %s, %s) from %s", n_new,
             len(results), seconds, n_new / seconds, recipe.dtype, recipe.kv_cache_dtype, model.embed.weight.device, ckpt)

    records = []
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        print(f"--- [{i + 1}/{len(results)}] {len(r.tokens)} tokens, finished by {r.finish_reason}")
        print(f"{prompt}\n{r.text}" if recipe.chat or recipe.messages_file else prompt + r.text, flush=True)
        records.append({"prompt": prompt, **asdict(r)})
    if recipe.run_dir is not None:
        with run_dir_lock(recipe.run_dir):
            run_dir = start_run(recipe, recipe.run_dir)
            atomic_write_text(run_dir / "generations.jsonl",
                              "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            record_config(recipe, run_dir)  # the config of the generations now there
        log.info("generate: wrote %s", run_dir / "generations.jsonl")
    return records


def report(res: list, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: each prompt and its completion."""
    out = []
    for g in res:
        out += [f"- prompt: `{g.get('prompt', '')!s}`", "", "  ```", *("  " + t for t in str(g.get("text", "")).splitlines()), "  ```"]
    return out


RECIPE = GenerateRecipe
run = run_generate
