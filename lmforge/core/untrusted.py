"""Reading what a user hands us without trusting it: YAML, names that become paths, templates.

- ``load_yaml``: ``yaml.safe_load`` with aliases bounded. A file of nine nested aliases is
  1 KB on disk and billions of nodes once anything walks it (hashing or dumping a config
  does); the composed document is measured as it would be expanded, and one past
  ``MAX_YAML_NODES`` is refused with the file, line and column of its first alias. Every
  error is one line, ``file:line:col: what``, as ``InputError``.
- ``path_name``: the one check of a name that becomes a file or folder name (a stage, round,
  sweep point, task, judge, output): no separators, no ``..``, not absolute, not empty.
- ``sandboxed_jinja``: the one Jinja environment for templates from user files (task
  fields): ``ImmutableSandboxedEnvironment``, so ``{{ cycler.__init__.__globals__ }}`` and
  its kin raise ``SecurityError`` instead of reaching Python, with ``*`` and ``**`` bounded;
  ``render_bounded`` caps what a template may output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import yaml

from lmforge.core.io import InputError

# A recipe, task or constitution has tens to hundreds of nodes; aliases that multiply that
# past a hundred thousand are a bomb, not a config.
MAX_YAML_NODES = 100_000


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures the expanded size of each document before constructing it."""

    max_nodes = MAX_YAML_NODES
    first_alias = None  # where the document first uses an alias: what a too-large error points at

    def compose_node(self, parent, index):  # noqa: ANN001, ANN201 - PyYAML's signature
        if self.first_alias is None and self.check_event(yaml.AliasEvent):
            self.first_alias = self.peek_event().start_mark
        return super().compose_node(parent, index)

    def get_single_node(self):  # noqa: ANN201 - PyYAML's signature
        node = super().get_single_node()
        if node is not None:
            check_expanded_size(node, self.max_nodes, self.first_alias)
        return node


class YAMLTooLarge(yaml.MarkedYAMLError):
    pass


def check_expanded_size(root: yaml.Node, limit: int, alias_mark: yaml.Mark | None = None) -> None:
    """Raise ``YAMLTooLarge`` (at ``alias_mark``, the first alias, when given) when ``root``
    expanded (every alias copied out) has more than ``limit`` nodes. Linear in the composed
    graph: a shared node's size is computed once."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if key in sizes and not done:
            alias_mark = alias_mark or node.start_mark
            continue
        children = node_children(node)
        if not done:
            sizes[key] = -1  # in progress: a cycle (a recursive alias) meets it
            stack.append((node, True))
            for child in children:
                if sizes.get(id(child)) == -1:
                    raise YAMLTooLarge(None, None, "a recursive alias (a node that contains itself)", child.start_mark)
                stack.append((child, False))
            continue
        sizes[key] = 1 + sum(sizes[id(child)] for child in children)
        if sizes[key] > limit:
            raise YAMLTooLarge(None, None, f"aliases expand this document past {limit:,} nodes "
                               "(nested anchors, a 'billion laughs'); write the values out instead",
                               alias_mark or node.start_mark)


def node_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, ``line:col: problem`` (PyYAML names the text it read
    ``"<unicode string>"``, not the file, and spreads the message over several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return f"{mark.line + 1}:{mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def load_yaml(text: str | bytes, source: str | Path, max_nodes: int = MAX_YAML_NODES) -> Any:
    """The YAML document ``text`` read from ``source`` (a file name, for errors): safe tags only,
    aliases bounded by ``max_nodes`` expanded nodes; any error is ``InputError`` in one line
    naming ``source:line:col``."""
    return compose_yaml(text, source, max_nodes)[0]


def compose_yaml(text: str | bytes, source: str | Path, max_nodes: int = MAX_YAML_NODES) -> tuple[Any, yaml.Node | None]:
    """``load_yaml``'s data and the composed node it was built from (its marks give each key's
    line), from one parse. The ``InputError``'s ``__cause__`` is PyYAML's error."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{source}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters at once
    except yaml.reader.ReaderError as exc:
        line, col = text.count("\n", 0, exc.position) + 1, exc.position - text.rfind("\n", 0, exc.position)
        raise InputError(f"{source}:{line}:{col}: character {chr(exc.character)!r} is not allowed in YAML "
                         "(a control character: is this a text file?)") from exc
    loader.max_nodes = max_nodes
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node is not None else None), node
    except yaml.YAMLError as exc:
        raise InputError(f"{source}:{yaml_error_line(exc)}") from exc
    finally:
        loader.dispose()


def read_yaml(path: str | Path, max_nodes: int = MAX_YAML_NODES) -> Any:
    """``load_yaml`` of the file at ``path``."""
    return load_yaml(Path(path).read_bytes(), path, max_nodes)


def path_name(name: object, key: str) -> str:
    """``name`` when it is safe as one file or folder name inside a run directory; otherwise
    ``InputError`` naming ``key`` (the recipe key it came from). Refused: a non-string, empty or
    blank names, ``.`` and ``..``, path separators, NUL and other control characters, and
    names over 200 characters."""
    if not isinstance(name, str):
        raise InputError(f"{key} must be a name (a string), got {type(name).__name__} {name!r}")
    problem = None
    if not name.strip():
        problem = "is empty"
    elif name in (".", ".."):
        problem = "is a relative path, not a name"
    elif "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        problem = "contains a path separator"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "contains a control character"
    elif len(name) > 200:
        problem = f"is {len(name)} characters long (at most 200)"
    if problem:
        raise InputError(f"{key} = {name!r} {problem}: it names a file in the run directory, so it must be "
                         "a plain name (letters, digits, '-', '_', '.'), not a path")
    return name


# A template renders a prompt: far below a million characters. Jinja's sandbox already caps
# range() at 100,000 items; these bound what it leaves open, ``'a' * 10**10`` and ``9**9**9``.
MAX_TEMPLATE_CHARS = 1_000_000
MAX_POWER_BITS = 4096


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with ``*`` and ``**`` bounded: a repeated string or list past
    ``MAX_TEMPLATE_CHARS`` items, or an integer power past ``MAX_POWER_BITS`` bits, is a
    ``SecurityError`` before it is computed."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_CHARS:
                    raise jinja2.sandbox.SecurityError(f"a template may not repeat a sequence past {MAX_TEMPLATE_CHARS:,} items")
        elif (isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
              and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS):
            raise jinja2.sandbox.SecurityError(f"a template may not compute a power past {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


def sandboxed_jinja(**options: Any) -> BoundedSandbox:
    """A Jinja environment for templates from user files: sandboxed (no attribute of Python
    internals, no mutation of what it is given, ``*``/``**`` bounded), strict about undefined
    names. Render with ``render_bounded``, which caps the output."""
    options.setdefault("undefined", jinja2.StrictUndefined)
    return BoundedSandbox(loader=jinja2.BaseLoader(), **options)


def render_bounded(template: jinja2.Template, context: dict[str, Any], max_chars: int = MAX_TEMPLATE_CHARS) -> str:
    """``template`` rendered with ``context``, stopped with ``SecurityError`` once its output
    passes ``max_chars`` (nested loops of ``range(100000)`` would otherwise run for hours)."""
    parts, size = [], 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise jinja2.sandbox.SecurityError(f"the template's output passed {max_chars:,} characters")
        parts.append(chunk)
    return "".join(parts)
