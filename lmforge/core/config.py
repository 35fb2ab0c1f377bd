"""Typed configuration: dataclasses loaded from YAML with dotted command-line overrides.

A recipe is a YAML mapping whose shape is a dataclass tree. ``load_config`` reads the
file with ``core.untrusted.load_yaml`` (safe tags, aliases bounded), applies ``a.b.c=value`` overrides, and builds the
dataclasses, checking every value against its annotation. Mistakes are reported with
the dotted key, the offending value and, for unknown keys, the closest valid key.

A field's help text and range live in its metadata (``option``, ``in_range``, ``positive``...):
``lmforge <verb> --help``, the docs' reference pages and the range errors all read them there.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import math
import os
import re
import sys
import types
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from lmforge.core.io import InputError
from lmforge.core.untrusted import load_yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override is invalid; the message says which key and why."""


# --------------------------------------------------------------------------- fields: help and ranges


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: bounds, each closed or open, and whether a float may
    be infinite (NaN never is). Declared in a field's metadata by ``positive``, ``at_least``..."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    allow_inf: bool = False
    also: tuple = ()  # values valid outside the bounds, e.g. -1 for "the rest"

    def admits(self, value: int | float) -> bool:
        if value in self.also:
            return True
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not self.allow_inf)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, finite: bool = True) -> str:
        """``in [0, 1]``, ``> 0``, ``-1 or >= 1``: what ``must be`` is followed by in an error."""
        if self.also:
            others = dataclasses.replace(self, also=())
            return " or ".join(_num(v) for v in self.also) + " or " + others.describe(finite)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        tail = " and finite" if finite and not self.allow_inf else ""
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}{tail}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}{tail}"
        return "finite" if finite and not self.allow_inf else "a number"


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING) -> Any:
    """A recipe key with no range: its default (or ``default_factory``) and its help, the text
    ``lmforge <verb> --help`` and the docs' reference show beside the key."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})


def field_help(f: dataclasses.Field) -> str:
    """A field's help text, declared by ``help=`` on ``option``, ``in_range``, ``positive``...; "" if none."""
    return f.metadata.get("help", "")


def in_range(default: Any = dataclasses.MISSING, low: float | None = None, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False, allow_inf: bool = False, also: tuple = (),
             keys: Range | None = None, help: str = "", **field_kwargs: Any) -> Any:
    """A dataclass field whose numbers must lie in the range (for a list or mapping: each entry,
    and with ``keys`` each key of a mapping); ``load_config`` checks it before anything runs.
    ``help`` is the key's help text, as for ``option``."""
    rng = Range(low, high, low_open, high_open, allow_inf, also)
    metadata = {"range": rng, "help": help, **({"key_range": keys} if keys is not None else {})}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def positive(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field that must be > 0 (and finite, for a float, unless ``allow_inf=True``)."""
    return in_range(default, 0, low_open=True, **kwargs)


def at_least(low: float, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field that must be >= ``low``."""
    return in_range(default, low, **kwargs)


def unit_interval(default: Any = dataclasses.MISSING, *, low_open: bool = False, high_open: bool = False,
                  **kwargs: Any) -> Any:
    """A fraction or probability: a field in [0, 1] (either end open if asked)."""
    return in_range(default, 0, 1, low_open=low_open, high_open=high_open, **kwargs)


SEED_MAX = 2**32 - 1  # numpy's RandomState takes seeds below 2^32


def seed_field(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A random seed: an integer in [0, 2^32 - 1], what every RNG the code seeds accepts."""
    return in_range(default, 0, SEED_MAX, **kwargs)


def plugin_field(default: Any = None, *, help: str = "") -> Any:
    """A ``module:function`` a recipe names: Python code lmforge imports and runs (a reward, a
    judge). Imported when the stage starts, never while the recipe is read; ``plugins`` lists
    them, and ``--print-config`` shows the list."""
    return dataclasses.field(default=default, metadata={"plugin": True, "help": help})


def load_plugin(spec: str, key: str, example: str = "my_module:my_function") -> Callable:
    """The callable a plugin field's ``module:function`` names, imported now (when its stage starts).
    The module is looked up on ``sys.path`` with the working directory first, as ``python -m`` and
    ``python script.py`` do, so a ``my_rewards.py`` beside the recipe's run needs no PYTHONPATH.
    Any failure is one ``ConfigError`` naming ``key``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r}: write it as module:function (e.g. {example})")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ConfigError(f"{key} = {spec!r}: cannot import {module_name!r}: {exc!r} (is it in the working "
                          "directory or on PYTHONPATH?)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def plugins(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, "module:function")`` of every plugin field set in a dataclass tree."""
    found = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if f.metadata.get("plugin") and value is not None:
            found.append((key, value))
        items = [(key, value)] if not isinstance(value, (list, tuple)) else [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        for item_key, item in items:
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                found += plugins(item, f"{item_key}.")
    return found


def field_range(f: dataclasses.Field) -> Range | None:
    """The range a field declares, if any."""
    return f.metadata.get("range")


def check_value_range(value: Any, f: dataclasses.Field, key: str, source: str) -> None:
    """Raise a one-line ``ConfigError`` (key, value, valid range) if a number of ``value`` (the
    value itself, a list's items, a mapping's values and keys) is outside ``f``'s range."""
    rng, key_rng = field_range(f), f.metadata.get("key_range")
    if rng is None or value is None:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if key_rng is not None and not _in(k, key_rng):
                raise ConfigError(f"{source}: '{key}' has the key {_num(k)}: keys must be {key_rng.describe(isinstance(k, float))}")
            _check_number(v, rng, f"{key}.{k}", source)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_number(v, rng, f"{key}[{i}]", source)
    else:
        _check_number(value, rng, key, source)


def _in(value: Any, rng: Range) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True  # the type check reports non-numbers
    return rng.admits(value)


def _check_number(value: Any, rng: Range, key: str, source: str) -> None:
    if not _in(value, rng):
        raise ConfigError(f"{source}: '{key}' = {_num(value)}: must be {rng.describe(isinstance(value, float))}")


def check_ranges(cfg: Any, prefix: str = "", source: str = "config") -> None:
    """Check every ranged field of a dataclass tree built in Python (``load_config`` checks
    recipes as it reads them): the same one-line error, with the dotted key."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        check_value_range(value, f, key, source)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ranges(value, f"{key}.", source)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    check_ranges(item, f"{key}[{i}].", source)


def _num(x: Any) -> str:
    """A number as a user would write it: ``-1`` for -1.0, ``0.0003``, ``nan``, ``inf``."""
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x) if isinstance(x, (int, float)) else str(x)


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where a recipe's values came from, for errors: its file, except the keys a command-line
    override set (an override's typo is not the recipe file's)."""

    recipe: str  # the recipe file
    overrides: dict[str, str]  # dotted key -> the override as typed
    label: str = "override"  # what the overrides are called: "command-line override" from the CLI

    def of(self, key: str, unknown: bool = False) -> str:
        """The source of ``key``'s value; an ``unknown`` key also comes from an override below it
        (``trian.lr=3`` makes the unknown section ``trian``)."""
        for overridden, item in self.overrides.items():
            if key == overridden or key.startswith((overridden + ".", overridden + "[")) or (
                    unknown and overridden.startswith(key + ".")):
                return f"{self.label} {item!r}"
        return self.recipe

    def of_checks(self, section: str, message: str, preset_keys: Collection[str] = ()) -> str:
        """The source of an error that ``section``'s own checks raised (its ``__post_init__``,
        across keys: ``warmup_steps must be in [0, max_steps]``): the overrides of keys in it that
        ``message`` names (``train.warmup_steps=500``, named as ``warmup_steps``), else as ``of``.
        ``preset_keys``: the keys the section's preset filled in; a message naming one of them
        blames the override that set the preset too (``model.preset=gemma2-2b``'s sliding_window)."""
        prefix = f"{section}." if section else ""
        named = [item for key, item in self.overrides.items()
                 if key.startswith(prefix) and key != section and _names(message, key.removeprefix(prefix))]
        preset = self.overrides.get(f"{prefix}preset")
        if preset is not None and preset not in named and any(_names(message, key) for key in preset_keys):
            named.insert(0, preset)
        if not named or self.of(section) != self.recipe:
            return self.of(section)
        return f"{self.label}{'s' if len(named) > 1 else ''} {', '.join(map(repr, named))}"


def _names(message: str, key: str) -> bool:
    """Whether ``message`` mentions ``key`` (dotted, relative to the section that raised it) as a whole word."""
    return re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", message) is not None


def _source(source: str | Sources, key: str, unknown: bool = False) -> str:
    return source.of(key, unknown) if isinstance(source, Sources) else source


def _checks_source(source: str | Sources, section: str, message: str, preset_keys: Collection[str] = ()) -> str:
    return source.of_checks(section, message, preset_keys) if isinstance(source, Sources) else source


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                overrides_label: str = "override") -> T:
    """Build ``cls`` from a YAML recipe (optional) plus ``key.sub=value`` overrides. An error names
    the recipe file, or the override (as ``overrides_label 'key=value'``) that set the key."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe not found: {path}")
        try:
            loaded = load_yaml(path.read_bytes(), path)
        except InputError as exc:  # one line, file:line:col; aliases bounded
            raise ConfigError(str(exc)) from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of keys to values, got {type(loaded).__name__}")
        data = loaded
    for item in overrides or []:
        apply_override(data, item)
    if path is None:
        return from_dict(cls, data, source="overrides")  # every value given comes from an override
    keys = {item.partition("=")[0].strip(): item.strip() for item in overrides or []}
    return from_dict(cls, data, source=Sources(str(path), keys, overrides_label))


def parse_scalar(text: str) -> Any:
    """Parse an override value the way a user means it: ``3e-4`` is a float, ``[1,2]`` a list.

    YAML 1.1 reads ``3e-4`` as a string, so numbers are tried first.
    """
    stripped = text.strip()
    if re.fullmatch(r"[+-]?\d+", stripped):
        return int(stripped)
    try:
        return float(stripped)
    except ValueError:
        pass
    try:
        return load_yaml(stripped, "override") if stripped else ""
    except InputError:
        return text


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override to a nested dict in place."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.subkey=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = parse_scalar(raw)


# --------------------------------------------------------------------------- renamed keys


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A recipe key that moved: the old dotted key still works for one release, with a warning
    naming the new one. ``values`` maps old values to new ones where the meaning moved too
    (``eval.exact_match: false`` is ``score.name: none``). A recipe class declares its table as
    ``RENAMED_KEYS: ClassVar[dict[str, Renamed]]`` (old key -> ``Renamed``), read by ``from_dict``."""

    new: str
    values: dict | None = None


def move_renamed_keys(data: dict[str, Any], renamed: dict[str, Renamed], source: str | Sources) -> dict[str, Any]:
    """``data`` with every old key of ``renamed`` moved to its new key (the sections on the way are
    copied, so the caller's data stays as it was; sections the move empties are dropped). Setting
    both the old and the new key is an error naming both."""
    data = dict(data)
    for old, rename in renamed.items():
        *parents, leaf = old.split(".")
        node = _section(data, parents)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        where = _source(source, old)
        if rename.values is not None:
            if value not in rename.values:
                raise ConfigError(f"{where}: '{old}' = {_show(value)}: must be one of {list(rename.values)} "
                                  f"(or set '{rename.new}')")
            value = rename.values[value]
        _drop_empty(data, parents)
        *new_parents, new_leaf = rename.new.split(".")
        target = data
        for part in new_parents:
            target.setdefault(part, {})
            if not isinstance(target[part], dict):
                raise ConfigError(f"{where}: '{part}' must be a mapping to hold '{rename.new}'")
            target[part] = dict(target[part])
            target = target[part]
        if new_leaf in target:
            raise ConfigError(f"{where}: both '{old}' (deprecated) and '{rename.new}' are set: keep '{rename.new}'")
        target[new_leaf] = value
        logging.getLogger("lmforge").warning("%s: '%s' is deprecated: use '%s'", where, old, rename.new)
    return data


def _section(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The section of ``data`` at ``path``, each mapping on the way replaced by a copy; None if absent."""
    node = data
    for part in path:
        if not isinstance(node.get(part), dict):
            return None
        node[part] = dict(node[part])
        node = node[part]
    return node


def _drop_empty(data: dict[str, Any], path: list[str]) -> None:
    """Remove the innermost sections of ``path`` that are now empty."""
    for depth in range(len(path), 0, -1):
        *above, name = path[:depth]
        node = data
        for part in above:
            node = node[part]
        if node[name]:
            return
        del node[name]


# --------------------------------------------------------------------------- building


def from_dict(cls: type[T], data: Any, *, source: str | Sources = "config", prefix: str = "") -> T:
    """Build dataclass ``cls`` from nested plain data, type-checking each field."""
    section = prefix.rstrip(".")
    where = f"'{section}'" if prefix else "the recipe"
    if not isinstance(data, dict):
        raise ConfigError(f"{_source(source, section)}: {where} must be a mapping, got {_show(data)}")
    renamed = getattr(cls, "RENAMED_KEYS", None)
    if renamed and not prefix:  # a recipe's deprecated keys, dotted from its top
        data = move_renamed_keys(data, renamed, source)
    expand = getattr(cls, "expand_preset", None)
    preset_keys: list[str] = []  # the keys the section's 'preset' filled in, not the user
    if expand is not None:  # e.g. a model preset fills fields under the user's own keys
        try:
            expanded = expand(data)
        except ValueError as exc:
            raise ConfigError(f"{_source(source, prefix + 'preset')}: {where}: {exc}") from exc
        preset_keys = [key for key in expanded if key not in data]
        data = expanded
    select = getattr(cls, "class_for", None)
    if select is not None:  # e.g. a model family's config class, named by the section's 'family' key
        try:
            cls = select(data)
        except ValueError as exc:
            raise ConfigError(f"{_source(source, prefix + 'family')}: {where}: {exc}") from exc
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = str(unknown[0])
        raise ConfigError(f"{_source(source, prefix + key, unknown=True)}: unknown key '{prefix}{key}'{_suggestion(cls, key, prefix)}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name in data:
            value = data[name]
            if isinstance(value, dict):
                value = {**recipe_defaults(f, hints[name]), **value}
            kwargs[name] = _coerce(value, hints[name], key, source)
            check_value_range(kwargs[name], f, key, _source(source, key))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_source(source, key)}: missing required key '{key}'")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{_checks_source(source, section, str(exc), preset_keys)}: {where}: {exc}") from exc


def recipe_defaults(f: dataclasses.Field, tp: Any) -> dict[str, Any]:
    """The keys a section's ``default_factory`` sets apart from its class's own defaults (a
    recipe's ``train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=5e-6))``), so
    that setting one key of the section (``train.max_steps=3``) keeps the recipe's other
    defaults instead of falling back to the class's."""
    if f.default_factory is dataclasses.MISSING or not dataclasses.is_dataclass(tp) or hasattr(tp, "expand_preset"):
        return {}
    try:
        recipe, plain = f.default_factory(), tp()
    except (TypeError, ValueError):  # a class without defaults for every field: nothing to keep
        return {}
    if type(recipe) is not tp:
        return {}
    return {g.name: to_dict(getattr(recipe, g.name)) for g in dataclasses.fields(tp)
            if g.init and getattr(recipe, g.name) != getattr(plain, g.name)}


def _suggestion(cls: type, key: str, prefix: str) -> str:
    """``; did you mean 'x'?`` for an unknown key: a key of a section below that it names
    (``skip_bad_records`` for ``data.skip_bad_records``), else the closest key here with its help
    text, else the valid keys."""
    below = [k for k in _dotted_keys(cls) if k.endswith("." + key)]
    if below:
        return "; did you mean " + " or ".join(f"'{prefix}{k}'" for k in below[:3]) + "?"
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
    if not close:
        return f"; valid keys: {', '.join(sorted(fields))}"
    help_ = field_help(fields[close[0]])
    return f"; did you mean '{prefix}{close[0]}'{f' ({help_})' if help_ else ''}?"


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of a config dataclass tree, dotted (sections that are off until set included)."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if get_origin(tp) in (Union, types.UnionType):
            inner = [a for a in get_args(tp) if a is not type(None)]
            tp = inner[0] if len(inner) == 1 else tp
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            keys += _dotted_keys(tp, f"{prefix}{f.name}.")
    return keys


def _coerce(value: Any, tp: Any, key: str, source: str | Sources) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)

    def bad() -> ConfigError:
        return ConfigError(f"{_source(source, key)}: '{key}' must be {type_name(tp)}, got {_show(value)}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]) and isinstance(value, dict):
            return _coerce(value, options[0], key, source)  # a section's own error names the key inside it
        for arg in options:
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{_source(source, key)}: '{key}' must be one of {', '.join(repr(a) for a in args)}, got {_show(value)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, source=source, prefix=f"{key}.")
    if origin in (list, tuple):
        if isinstance(value, str) and origin is list and args and args[0] is str:
            value = [value]  # one path where a list of paths is expected
        if not isinstance(value, (list, tuple)):
            raise bad()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise bad()
            return tuple(_coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        ktp, vtp = args if args else (Any, Any)
        return {_coerce(k, ktp, key, source): _coerce(v, vtp, f"{key}.{k}", source) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 leaves "3e-4" a string
            except ValueError:
                pass
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise bad()
    raise ConfigError(f"{_source(source, key)}: '{key}' has an unsupported annotation {tp!r}")


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin is tuple:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# --------------------------------------------------------------------------- writing


def to_dict(cfg: Any) -> Any:
    """Plain nested data (dicts, lists, scalars) for a dataclass tree, ready for YAML."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML text; ``load_config`` on it gives back an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Any, run_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config into the run directory (atomically)."""
    from lmforge.core.io import atomic_write_text

    path = Path(run_dir) / name
    atomic_write_text(path, dump_config(cfg))
    return path


__all__ = [
    "ConfigError",
    "Range",
    "Sources",
    "apply_override",
    "at_least",
    "check_ranges",
    "dump_config",
    "field_help",
    "field_range",
    "from_dict",
    "in_range",
    "load_config",
    "option",
    "parse_scalar",
    "load_plugin",
    "plugin_field",
    "plugins",
    "positive",
    "save_config",
    "seed_field",
    "to_dict",
    "unit_interval",
]
