"""The ``lmforge`` command: a verb, a YAML recipe, and dotted overrides.

    lmforge tokenizer recipes/demo/tokenizer.yaml tokenizer.vocab_size=4096
    lmforge prepare recipes/demo/prepare.yaml --print-config
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import json
import os
import sys
import textwrap
import types
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from lmforge import __version__
from lmforge.core.config import ConfigError, dump_config, field_help, load_config, parse_scalar, plugins, type_name
from lmforge.core.io import InputError
from lmforge.core.run import RunDiverged, RunStopped, setup_logging
from lmforge.stages import VERBS, VERBS_BY_NAME, Verb


class RecipeKey(NamedTuple):
    """One row of a verb's key table."""

    key: str  # dotted from the recipe's top; an entry of a list of mappings is named alone
    type: str
    default: str  # as the help shows it: "default 0.1", "required", "default None (derived: 6)"
    help: str  # the field's help metadata (``core.config.field_help``)
    depth: int  # 1 for the keys of a list's entries, shown indented under the list
    value: Any  # the default itself, for the example override


def declared_default(f: dataclasses.Field) -> Any:
    """The default written in the dataclass, before ``__post_init__`` fills anything in."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def optional_dataclass(tp: Any) -> type | None:
    """``X`` for a ``X | None`` field whose ``X`` is a dataclass (a section that is off until set)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def list_entry_dataclass(tp: Any) -> type | None:
    """``X`` for a ``list[X]`` field whose entries are dataclasses."""
    args = get_args(tp)
    if get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def short_repr(value: Any, limit: int = 150) -> str:
    """``repr(value)``, cut at a word boundary to at most ``limit`` characters."""
    return textwrap.shorten(repr(value), limit, placeholder=" ...")


def recipe_keys(cls: type, defaults: Any = None, prefix: str = "", depth: int = 0) -> list[RecipeKey]:
    """A row for every key of a recipe dataclass, nested sections flattened to dotted keys.

    ``defaults`` is the instance the enclosing recipe builds (its default factory may set
    other values than ``cls()``). A field whose ``__post_init__`` fills in the default from
    other fields (``n_kv_heads: None`` becomes ``n_heads``) shows its declared default marked
    "derived", so a computed value is not read as a fixed one.
    """
    try:
        fresh = cls()
    except (TypeError, ValueError):  # entries of a list may have required fields
        fresh = None
    if defaults is None:
        defaults = fresh
    hints = get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        declared = declared_default(f)
        value = declared if defaults is None else getattr(defaults, f.name)
        help_ = field_help(f)
        if dataclasses.is_dataclass(tp):
            rows += recipe_keys(tp, value, f"{key}.", depth)
            continue
        if declared is dataclasses.MISSING:
            rows.append(RecipeKey(key, type_name(tp), "required", help_, depth, None))
            continue
        if fresh is not None and declared != getattr(fresh, f.name):
            resolved = f": {value!r}" if isinstance(value, (int, float, str)) else ""
            shown = f"default {short_repr(declared)} (derived{resolved})"
            value = declared
        else:
            shown = f"default {short_repr(value)}"
        if (entry := list_entry_dataclass(tp)) is not None:
            names = ", ".join(g.name for g in dataclasses.fields(entry) if g.init)
            rows.append(RecipeKey(key, f"list of {{{names}}}", shown, help_, depth, value))
            rows += recipe_keys(entry, None, "", depth + 1)
        elif (section := optional_dataclass(tp)) is not None:
            if value is None:
                shown += f"; the {key}.* keys below turn it on"
            else:
                shown = f"default the {key}.* keys below; null turns it off"
            rows.append(RecipeKey(key, type_name(tp), shown, help_, depth, None))
            rows += recipe_keys(section, value, f"{key}.", depth)
        else:
            rows.append(RecipeKey(key, type_name(tp), shown, help_, depth, value))
    return rows


HELP_WIDTH = 100


def key_table(rows: list[RecipeKey]) -> str:
    """The rows as columns of key, type and default, each key's help on the lines below.

    A type too long for its column wraps within it and a default too long for its column
    gets a line of its own, so the columns stay aligned and no line is wider than HELP_WIDTH.
    """
    key_width = min(max(len(r.key) + 2 * r.depth for r in rows) + 2, 36)
    type_width = max(min(max(len(r.type) for r in rows) + 2, HELP_WIDTH - 2 - key_width - 28), 20)
    default_width = HELP_WIDTH - 2 - key_width - type_width
    lines = []
    for r in rows:
        indent = "  " * r.depth
        name = indent + r.key
        below = " " * 6 + indent
        types_ = textwrap.wrap(r.type, type_width - 2, break_long_words=False, break_on_hyphens=False) or [""]
        beside = r.default if len(r.default) <= default_width else ""
        if len(name) >= key_width:
            lines.append(f"  {name}")
            name = ""
        for i, type_part in enumerate(types_):
            key_part, default_part = (name, beside) if i == 0 else ("", "")
            lines.append(f"  {key_part:<{key_width}}{type_part:<{type_width}}{default_part}".rstrip())
        if not beside:
            lines += textwrap.wrap(r.default, HELP_WIDTH, initial_indent=below, subsequent_indent=below + "  ")
        if r.help:
            lines += textwrap.wrap(r.help, HELP_WIDTH, initial_indent=below, subsequent_indent=below)
    return "\n".join(lines)


def family_keys(cls: type) -> str:
    """For the model section of recipe ``cls`` (a ``ModelConfig`` field), what each model family
    changes of the keys the table lists (``ModelConfig``'s, the llama family's): the values it holds
    keys at, the keys it fixes (not keys of its recipe), the defaults it sets and the keys it adds.
    Empty for a recipe without one."""
    from lmforge.model.config import ModelConfig
    from lmforge.model.families import FAMILIES

    hints = get_type_hints(cls)
    sections = [f.name for f in dataclasses.fields(cls) if hints[f.name] is ModelConfig]
    if not sections:
        return ""
    base = {f.name: declared_default(f) for f in dataclasses.fields(ModelConfig) if f.init}
    parts = []
    for family in FAMILIES.values():
        if family.config is ModelConfig:
            continue
        own = {f.name: f for f in dataclasses.fields(family.config) if f.init}
        changed = [f"{n}={short_repr(declared_default(f), 40)}" for n, f in own.items()
                   if n in base and n != "family" and declared_default(f) != base[n]]
        fixed = [n for n in base if n not in own]
        lines = textwrap.wrap(f"{sections[0]}.family={family.name}: {family.summary}", HELP_WIDTH,
                              initial_indent="  ", subsequent_indent=" " * 6)
        held = getattr(family.config, "FIXED_FIELDS", {})
        if held:
            lines += textwrap.wrap("held at one value (another is refused): " + ", ".join(
                f"{n}={short_repr(v, 40)}" for n, (v, _) in held.items()), HELP_WIDTH, initial_indent=" " * 6,
                subsequent_indent=" " * 8)
        if changed:
            lines += textwrap.wrap("defaults: " + ", ".join(changed), HELP_WIDTH, initial_indent=" " * 6,
                                   subsequent_indent=" " * 8)
        if fixed:
            lines += textwrap.wrap("fixed by the family, not keys: " + ", ".join(fixed), HELP_WIDTH,
                                   initial_indent=" " * 6, subsequent_indent=" " * 8)
        added = [r for r in recipe_keys(family.config, prefix=f"{sections[0]}.", depth=2)
                 if r.key.removeprefix(f"{sections[0]}.") not in base]
        parts.append("\n".join(lines) + ("\n" + key_table(added) if added else ""))
    return (f"model families ({', '.join(sections)}.family, or a preset, picks one; the table above is the llama "
            "family's keys):\n" + "\n".join(parts))


def override_text(value: Any) -> str:
    """``value`` as it would be written after ``key=`` on the command line."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str) and value and parse_scalar(value) == value and " " not in value:
        return value
    return json.dumps(value)


def example_override(rows: list[RecipeKey]) -> str:
    """A ``key=value`` from this verb's own recipe, at its default, for the overrides' help.

    A number if the recipe has one (a dotted key first, to show the nesting), else a flag,
    a choice, a string.
    """
    keys = [r for r in rows if r.depth == 0 and isinstance(r.value, (bool, int, float, str))]
    if not keys:
        return "key=value"

    def rank(r: RecipeKey) -> tuple[int, bool]:
        if isinstance(r.value, bool):
            kind = 1
        elif isinstance(r.value, (int, float)):
            kind = 0
        else:
            kind = 2 if r.type.startswith("one of") else 3
        return kind, "." not in r.key

    best = min(keys, key=rank)
    return f"{best.key}={override_text(best.value)}"


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


def entry_summary(cls: type) -> str:
    """The first paragraph of a config class's docstring, on one line; "" if it has none."""
    doc = (cls.__doc__ or "").strip()
    summary = "" if doc.startswith(f"{cls.__name__}(") else doc.split("\n\n")[0]  # a dataclass's own: no docstring
    return " ".join(summary.split())


def entry_keys(title: str, entries: list[tuple[str, type]]) -> str:
    """``title``, then each kind of entry of a list key (curate's step types) with the first line
    of its config class's docstring and the table of its keys, from their help metadata."""
    parts = [title]
    for name, cls in entries:
        parts += textwrap.wrap(f"{name}: {entry_summary(cls)}".rstrip(": "), HELP_WIDTH, initial_indent="  ",
                               subsequent_indent=" " * 6)
        if rows := recipe_keys(cls, depth=1):
            parts.append(key_table(rows))
    return "\n".join(parts)


class VerbParser(argparse.ArgumentParser):
    """A verb's parser; its recipe-key table (the fields of the stage module's ``RECIPE`` with
    their help metadata, and its ``help_entries``: sections of ``(title, [(name, config class)])``,
    as what the entries of a list key may be, each with its own keys) is built only when help is
    printed, not on every run: `lmforge scaling`'s ``RECIPE`` imports torch, which its fit never needs."""

    def __init__(self, *args, module: types.ModuleType, **kwargs):
        super().__init__(*args, **kwargs)
        self.module = module

    def format_help(self) -> str:
        recipe, entries = self.module.RECIPE, getattr(self.module, "help_entries", None)
        rows = recipe_keys(recipe)
        self.epilog = f"recipe keys (set in the YAML recipe or as key=value overrides):\n{key_table(rows)}"
        if families := family_keys(recipe):
            self.epilog += f"\n\n{families}"
        for title, items in entries() if entries is not None else []:
            self.epilog += f"\n\n{entry_keys(title, items)}"
        example = example_override(rows).replace("%", "%%")  # argparse formats help with %
        for action in self._actions:
            if action.dest == "overrides":
                action.help = f"overrides of the recipe keys below, e.g. {example}"
        return super().format_help()


def build_verb_parser(verb: Verb) -> tuple[argparse.ArgumentParser, types.ModuleType]:
    module = verb.load()
    doc = (module.__doc__ or verb.summary).strip()
    p = VerbParser(prog=f"lmforge {verb.name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                   module=module)
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    else:
        p.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the recipe keys below")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p, module


def refuse_torchrun(verb: Verb) -> None:
    """A verb that runs in one process stops under ``torchrun``: every rank would do the same
    work into the same files."""
    from lmforge.distributed.config import launched_world_size

    world_size = launched_world_size()
    if world_size > 1 and not verb.distributed:
        ranked = ", ".join(v.name for v in VERBS if v.distributed)
        raise ConfigError(f"`lmforge {verb.name}` runs in one process, but WORLD_SIZE={world_size}: launch it without "
                          f"torchrun (under torchrun, run the training stages one at a time: {ranked})")


# a full disk, a quota, a read-only or forbidden place: the machine's state, not a bug to trace
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(exc: OSError) -> str:
    """One line for an ``OSError`` of ``WRITE_ERRORS``: the path where known, the system's words.
    Every output is written to a temporary sibling and renamed into place, so what a run wrote
    before (checkpoints, a prepared dataset) is as it was."""
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc} (outputs written before are unchanged)"


def plugin_lines(found: list[tuple[str, str]]) -> str:
    """``--print-config``'s closing comment: the Python code the recipe will import and run."""
    if not found:
        return "# plugins: none (this recipe imports and runs no code of yours)\n"
    lines = ["# plugins: this recipe imports and runs these functions when its stage starts"]
    return "\n".join([*lines, *(f"#   {key}: {spec}" for key, spec in found)]) + "\n"


def print_error(verb: str, message: str, same_on_every_rank: bool) -> None:
    """``lmforge <verb>: error: <message>`` on stderr. Under torchrun every rank runs ``main``: an
    error that every rank of a machine meets alike is printed by its first rank (LOCAL_RANK 0)
    alone, and the others exit with the same status without it. Alike are the errors of reading
    the recipe and overrides (each rank reads the same files) and a divergence (``RunDiverged``:
    every rank decides it from the same all-reduced loss, gradient norm and weight count). An
    error raised inside a stage may be one rank's own (a data shard only it reads), so every rank
    prints those."""
    if same_on_every_rank and os.environ.get("LOCAL_RANK", "0") != "0":
        return
    print(f"lmforge {verb}: error: {message}", file=sys.stderr)


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
    running = False  # whether the stage itself has started (see print_error)
    try:
        if hasattr(module, "recipe_from_args"):
            cfg = module.recipe_from_args(args)
        else:
            recipe, overrides = args.recipe, list(args.overrides)
            if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
                recipe, overrides = None, [recipe, *overrides]
            cfg = load_config(module.RECIPE, recipe, overrides, overrides_label="command-line override")
        if args.print_config:
            sys.stdout.write(dump_config(cfg) + plugin_lines(getattr(module, "recipe_plugins", plugins)(cfg)))
            return 0
        refuse_torchrun(verb)
        running = True
        module.run(cfg)
    except (ConfigError, InputError) as exc:
        print_error(verb.name, str(exc), same_on_every_rank=not running)
        return 2
    except (RunDiverged, RunStopped) as exc:
        # The recipe was valid and the run failed, so exit status 1 (2 is bad input): one line, as
        # the message already says the step, what was kept and what to change; no traceback.
        print_error(verb.name, str(exc), same_on_every_rank=True)
        return 1
    except OSError as exc:
        if exc.errno not in WRITE_ERRORS:
            raise
        print_error(verb.name, write_error(exc), same_on_every_rank=False)
        return 2
    except KeyboardInterrupt:
        print(f"lmforge {verb.name}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
