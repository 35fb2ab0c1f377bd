"""The ``lmforge`` command: a verb, a YAML recipe, and dotted overrides.

    lmforge tokenizer recipes/demo/tokenizer.yaml tokenizer.vocab_size=4096
    lmforge prepare recipes/demo/prepare.yaml --print-config
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import sys
import types
from typing import get_type_hints

from lmforge import __version__
from lmforge.core.config import ConfigError, dump_config, load_config, type_name
from lmforge.core.io import InputError
from lmforge.core.run import setup_logging
from lmforge.stages import VERBS, VERBS_BY_NAME, Verb

FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s*(.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """The comment written beside (or on the lines just above) each field of a config dataclass
    and of the dataclasses it inherits from: the source is the documentation of every key."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# "))
                continue
            match = FIELD_LINE.match(line)
            if match and not stripped.startswith(("def ", "@", "return")):
                text = match.group(2) or " ".join(above)
                if text:
                    comments[match.group(1)] = text.strip()
            above = []
    return comments


def recipe_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, comment) for every leaf of a recipe dataclass."""
    rows = []
    hints = get_type_hints(cls)
    defaults = cls()
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            rows += recipe_keys(tp, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", type_name(tp), repr(value), comments.get(f.name, "")))
    return rows


def build_parser() -> argparse.ArgumentParser:
    verbs = "\n".join(f"  {v.name:<11} {v.summary}" for v in VERBS)
    parser = argparse.ArgumentParser(
        prog="lmforge",
        usage="lmforge <verb> [recipe.yaml] [key=value ...]",
        description="lmforge: from raw documents to a trained, evaluated language model.\n"
        "Each verb runs one stage from a YAML recipe; override any key with key.subkey=value.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"verbs:\n{verbs}\n\nRun `lmforge <verb> --help` for what a verb does and its recipe keys.",
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    parser.add_argument("verb", nargs="?", help=argparse.SUPPRESS)
    return parser


def build_verb_parser(verb: Verb) -> tuple[argparse.ArgumentParser, types.ModuleType]:
    module = verb.load()
    doc = (module.__doc__ or verb.summary).strip()
    keys = "\n".join(f"  {k:<34} {t:<18} default {d}" + (f"\n      {c}" if c else "")
                     for k, t, d, c in recipe_keys(module.RECIPE))
    p = argparse.ArgumentParser(
        prog=f"lmforge {verb.name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"recipe keys (set in the YAML recipe or as key=value overrides):\n{keys}",
    )
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    else:
        p.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=3e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in VERBS_BY_NAME:
        parser = build_parser()
        args, _ = parser.parse_known_args(argv)  # handles --help and --version
        if args.verb is not None:
            close = difflib.get_close_matches(args.verb, list(VERBS_BY_NAME), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            parser.error(f"unknown verb '{args.verb}'{hint} (verbs: {', '.join(VERBS_BY_NAME)})")
        parser.print_help()
        return 0
    verb = VERBS_BY_NAME[argv[0]]
    parser, module = build_verb_parser(verb)
    args = parser.parse_intermixed_args(argv[1:])
    setup_logging()
    try:
        if hasattr(module, "recipe_from_args"):
            cfg = module.recipe_from_args(args)
        else:
            recipe, overrides = args.recipe, list(args.overrides)
            if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
                recipe, overrides = None, [recipe, *overrides]
            cfg = load_config(module.RECIPE, recipe, overrides)
        if args.print_config:
            sys.stdout.write(dump_config(cfg))
            return 0
        module.run(cfg)
    except (ConfigError, InputError) as exc:
        print(f"lmforge {verb.name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmforge {verb.name}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
