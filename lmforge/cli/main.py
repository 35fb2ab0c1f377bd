"""The ``lmforge`` command: a verb, a YAML recipe, and dotted overrides.

    lmforge tokenizer recipes/demo/tokenizer.yaml tokenizer.vocab_size=4096
    lmforge prepare recipes/demo/prepare.yaml --print-config
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from lmforge import __version__
from lmforge.core.config import ConfigError, dump_config, load_config
from lmforge.core.io import InputError
from lmforge.core.run import setup_logging


@dataclass
class Verb:
    name: str
    summary: str  # one line for `lmforge --help`
    description: str  # a paragraph for `lmforge <verb> --help`
    recipe: Callable[[], type]  # imported lazily so `lmforge --help` stays fast
    run: Callable[[], Callable[[Any], Any]]


def _tokenizer_recipe() -> type:
    from lmforge.stages.tokenizer import TokenizerRecipe

    return TokenizerRecipe


def _tokenizer_run() -> Callable:
    from lmforge.stages.tokenizer import run_tokenizer

    return run_tokenizer


def _prepare_recipe() -> type:
    from lmforge.stages.prepare import PrepareRecipe

    return PrepareRecipe


def _prepare_run() -> Callable:
    from lmforge.stages.prepare import run_prepare

    return run_prepare


VERBS = [
    Verb(
        "tokenizer",
        "train a byte-level BPE tokenizer (tokenizer.json, HF-compatible)",
        "Train a byte-level BPE tokenizer with the `tokenizers` library on the configured documents, "
        "reserve special and ChatML tokens, save tokenizer.json + tokenizer_config.json into run_dir "
        "and report compression (bytes per token) on held-out documents.",
        _tokenizer_recipe,
        _tokenizer_run,
    ),
    Verb(
        "prepare",
        "tokenize documents into memory-mapped train/val token shards",
        "Tokenize JSONL, Parquet and plain-text documents into token shards (a flat uint16/uint32 "
        "token array plus a document index per shard) with a manifest, split into train and "
        "validation by a stable hash of each document id.",
        _prepare_recipe,
        _prepare_run,
    ),
]


def recipe_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, default) for every leaf of a recipe dataclass."""
    rows = []
    hints = get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            rows += recipe_keys(tp, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", _type_label(tp), repr(value)))
    return rows


def _type_label(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_label(a) for a in args)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (list, tuple):
        return f"list[{_type_label(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return getattr(tp, "__name__", str(tp))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="lmforge: from raw documents to a trained, evaluated language model. "
        "Each verb runs one stage from a YAML recipe; override any key with key.subkey=value.",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32),
        epilog="Run `lmforge <verb> --help` for a verb's recipe keys.",
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>", title="verbs")
    for verb in VERBS:
        cls = verb.recipe()
        keys = "\n".join(f"  {k:<34} {t:<18} default {d}" for k, t, d in recipe_keys(cls))
        p = sub.add_parser(
            verb.name,
            help=verb.summary,
            description="\n".join(textwrap.wrap(verb.description, 88)),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"recipe keys (set in the YAML recipe or as key=value overrides):\n{keys}",
        )
        p.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. tokenizer.vocab_size=4096")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.set_defaults(verb_obj=verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 0
    verb: Verb = args.verb_obj
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        recipe, overrides = None, [recipe, *overrides]
    setup_logging()
    try:
        cfg = load_config(verb.recipe(), recipe, overrides)
        if args.print_config:
            sys.stdout.write(dump_config(cfg))
            return 0
        verb.run()(cfg)
    except (ConfigError, InputError) as exc:
        print(f"lmforge {verb.name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmforge {verb.name}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
