"""MkDocs hooks of the docs site (mkdocs.yml): the pages written from the code, and links out of docs/.

- ``reference/<verb>.md``: each verb's ``--help`` and its recipe keys (type, default, help), and the
  entries its ``--help`` lists below them (curate's step types, each with its keys), from the functions
  ``lmforge <verb> --help`` itself uses (``lmforge.cli.main``), so the two cannot disagree.
- ``api/<package>.md``: the public functions and classes of a package's modules, which mkdocstrings
  renders from their docstrings.
- A link from docs/ to a file outside it (``../README.md``, which GitHub follows) is checked to exist
  and shown in the site as its text and the file's path, since the site holds only docs/; a link to a
  file that does not exist stays a warning, which ``--strict`` turns into a failed build.

The generated pages exist only in the build: nothing is written into docs/.
"""

from __future__ import annotations

import argparse
import html
import logging
import pkgutil
import posixpath
import re
from functools import cache
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.lmforge")

# The packages whose modules get an API page: the pure, docstring-rich layers a user calls or extends.
API_PACKAGES = ["lmforge.objectives", "lmforge.rl", "lmforge.peft", "lmforge.scaling", "lmforge.core"]
# Modules left off their package's page (none yet).
API_SKIP: set[str] = set()


@cache
def verbs() -> list:
    from lmforge.stages import VERBS

    return [v for v in VERBS if hasattr(v.load(), "RECIPE")]


def code_spans(text: str) -> str:
    """Escaped ``text`` as HTML, its `back-quoted` parts as <code>."""
    parts = re.split(r"`([^`]+)`", text)
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def key_table_html(rows: list, id_prefix: str = "") -> str:
    """The rows of ``recipe_keys`` as an HTML table (a Markdown table would break on the ``|`` of types
    and help text); a list's entry keys are indented under the list, as in ``--help``. Each row's id
    is ``id_prefix`` and its key, so that the tables of one page do not repeat an id."""
    lines = ["<table>", "<thead><tr><th>key</th><th>type</th><th>default</th><th>help</th></tr></thead>", "<tbody>"]
    for r in rows:
        indent = "&emsp;" * r.depth + ("↳ " if r.depth else "")
        default = r.default.removeprefix("default ")
        keep_whole = ' style="white-space: nowrap"' if len(default) <= 24 else ""  # wrap long values only
        lines.append(
            f'<tr id="{html.escape(id_prefix + r.key)}"><td style="white-space: nowrap">{indent}<code>{html.escape(r.key)}</code></td>'
            f"<td>{html.escape(r.type)}</td><td{keep_whole}><code>{html.escape(default)}</code></td>"
            f"<td>{code_spans(r.help)}</td></tr>"
        )
    lines += ["</tbody>", "</table>"]
    return "\n".join(lines)


def entry_sections(module) -> list[str]:
    """The Markdown of what a verb's ``help_entries`` lists below its recipe keys in ``--help``
    (curate's step types): per section its title as a heading (what the title has in parentheses
    below it), then per entry a heading, the summary of its config class and the table of its keys
    (row ids ``<entry>.<key>``)."""
    from lmforge.cli.main import entry_summary, recipe_keys

    parts = []
    for title, entries in module.help_entries() if hasattr(module, "help_entries") else []:
        heading, _, note = title.rstrip(":").partition(" (")
        parts.append(f"## {heading[0].upper() + heading[1:]}")
        if note := note.removesuffix(")"):
            parts.append(code_spans(note[0].upper() + note[1:]) + ".")
        for name, cls in entries:
            parts.append(f"### `{name}`")
            if summary := entry_summary(cls):
                parts.append(code_spans(summary))
            if rows := recipe_keys(cls):
                parts.append(key_table_html(rows, id_prefix=f"{name}."))
    return parts


def reference_page(verb) -> str:
    """A verb's page: its summary, its ``--help`` above the key table, the key table, and the
    entries its ``--help`` lists below the table (curate's step types), each with its keys."""
    from lmforge.cli.main import build_verb_parser, recipe_keys

    parser, module = build_verb_parser(verb)
    usage = argparse.ArgumentParser.format_help(parser).strip()  # the help without its key table
    rows = recipe_keys(module.RECIPE)
    return "\n\n".join([
        f"# lmforge {verb.name}",
        verb.summary[0].upper() + verb.summary[1:] + ".",
        f"```text\n$ lmforge {verb.name} --help\n{usage}\n```",
        "## Recipe keys",
        "Set in the YAML recipe or on the command line as `key=value` (a dotted key reaches into a section). "
        "`lmforge " + verb.name + " --help` prints the same table.",
        key_table_html(rows),
        *entry_sections(module),
    ]) + "\n"


def reference_index() -> str:
    rows = "\n".join(f"| [`{v.name}`]({v.name}.md) | {html.escape(v.summary)} |" for v in verbs())
    return (
        "# Config reference\n\nEvery recipe key of every verb, with its type, default and help, written from "
        "the config dataclasses when the site is built (the same table `lmforge <verb> --help` prints).\n\n"
        f"| verb | what it does |\n| --- | --- |\n{rows}\n"
    )


def api_modules(package: str) -> list[str]:
    import importlib

    path = importlib.import_module(package).__path__
    names = [f"{package}.{m.name}" for m in pkgutil.iter_modules(path) if not m.name.startswith("_")]
    return [n for n in names if n not in API_SKIP]


def api_page(package: str) -> str:
    import importlib

    doc = (importlib.import_module(package).__doc__ or "").strip()
    blocks = [f"::: {name}" for name in api_modules(package)]
    return f"# `{package}`\n\n{doc}\n\n" + "\n\n".join(blocks) + "\n"


def api_index() -> str:
    rows = "\n".join(f"- [`{p}`]({p.removeprefix('lmforge.')}.md)" for p in API_PACKAGES)
    return f"# API\n\nThe public functions and classes of these packages, from their docstrings:\n\n{rows}\n"


def generated_pages() -> dict[str, str]:
    pages = {"reference/index.md": reference_index()}
    pages |= {f"reference/{v.name}.md": reference_page(v) for v in verbs()}
    pages["api/index.md"] = api_index()
    pages |= {f"api/{p.removeprefix('lmforge.')}.md": api_page(p) for p in API_PACKAGES}
    return pages


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """The generated pages join the nav after the written ones."""
    config.nav = (config.nav or []) + [
        {"Config reference": ["reference/index.md"] + [{v.name: f"reference/{v.name}.md"} for v in verbs()]},
        {"API": ["api/index.md"] + [{p: f"api/{p.removeprefix('lmforge.')}.md"} for p in API_PACKAGES]},
    ]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for src_uri, content in generated_pages().items():
        files.append(File.generated(config, src_uri, content=content))
    return files


LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Links that leave docs/ become their text and the repository path; a missing target warns."""
    docs_dir = Path(config.docs_dir).resolve()
    repo = docs_dir.parent
    page_dir = posixpath.dirname(page.file.src_uri)

    def outside(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = (docs_dir / page_dir / path).resolve()
        if resolved.is_relative_to(docs_dir):
            return match.group(0)  # mkdocs checks links inside docs/ itself
        if not resolved.exists():
            log.warning(f"Doc file '{page.file.src_uri}' links to '{target}', which does not exist in the repository")
            return text
        shown = resolved.relative_to(repo).as_posix()
        return text if text.strip("`") == shown else f"{text} (`{shown}`)"

    pieces, last = [], 0
    for fence in FENCE.finditer(markdown):
        pieces += [LINK.sub(outside, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    pieces.append(LINK.sub(outside, markdown[last:]))
    return "".join(pieces)
