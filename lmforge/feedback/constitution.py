"""A constitution: written principles a critic or judge applies (Bai et al. 2022).

A YAML file with a ``name`` and a list of ``principles``. Each principle has a ``name`` and
the three texts the paper's two phases use:

- ``critique``: the critique request of SL-CAI ("identify ways in which the response ..."),
  asked after the policy's response;
- ``revision``: the revision request that follows the critique ("rewrite the response to ...");
- ``comparison``: the multiple-choice question of RL-CAI ("which of these responses is ..."),
  asked with the two responses as options (A) and (B).

  name: demo_tasks
  principles:
    - name: correct
      critique: Check the answer ... Say what is wrong with it.
      revision: Rewrite the answer so that ...
      comparison: Which answer gives the correct result?

The file is read with ``lmforge.core.untrusted.load_yaml``: safe tags only, aliases bounded,
a syntax error one line ``file:line:col: what``. No principles, a principle without one of its
three texts (or with an empty one), a duplicate name and an unknown key are ``InputError``s
naming the file and the principle (its index and name).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from lmforge.core.io import InputError
from lmforge.core.untrusted import load_yaml

TEXTS = ("critique", "revision", "comparison")
PRINCIPLE_KEYS = ("name", *TEXTS)
TOP_KEYS = ("name", "description", "principles")


@dataclass(frozen=True)
class Principle:
    name: str
    critique: str  # SL-CAI: the critique request
    revision: str  # SL-CAI: the revision request
    comparison: str  # RL-CAI: the multiple-choice question over (A) and (B)


@dataclass(frozen=True)
class Constitution:
    name: str
    principles: tuple[Principle, ...]
    source: str  # the file it was read from
    sha256: str  # of the file's bytes: a changed constitution is a changed recipe

    def principle(self, index: int) -> Principle:
        return self.principles[index % len(self.principles)]


def load_constitution(path: str | Path) -> Constitution:
    """The constitution in the YAML file ``path`` (see the module docstring for its checks)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"constitution not found: {path}")
    raw = path.read_bytes()
    data = load_yaml(raw, path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: a constitution is a mapping with 'name' and 'principles', got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise InputError(f"{path}: unknown key(s) {unknown}; a constitution has {list(TOP_KEYS)}")
    items = data.get("principles")
    if not isinstance(items, list) or not items:
        raise InputError(f"{path}: no principles: 'principles' must be a non-empty list of "
                         f"{{{', '.join(PRINCIPLE_KEYS)}}} mappings")
    principles = [parse_principle(path, i, item) for i, item in enumerate(items)]
    names = [p.name for p in principles]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InputError(f"{path}: principle {i} ({name!r}) has the same name as principle {names.index(name)}")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"{path}: 'name' must be a non-empty string, got {name!r}")
    return Constitution(name, tuple(principles), str(path), hashlib.sha256(raw).hexdigest())


def parse_principle(path: Path, index: int, item: object) -> Principle:
    if not isinstance(item, dict):
        raise InputError(f"{path}: principle {index} must be a mapping of {list(PRINCIPLE_KEYS)}, "
                         f"got {type(item).__name__}")
    where = f"{path}: principle {index}" + (f" ({item['name']!r})" if isinstance(item.get("name"), str) else "")
    unknown = sorted(set(item) - set(PRINCIPLE_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; a principle has {list(PRINCIPLE_KEYS)}")
    for key in PRINCIPLE_KEYS:
        value = item.get(key)
        if value is None:
            raise InputError(f"{where}: missing its {key!r}" + (" request" if key in ("critique", "revision") else ""))
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return Principle(**{k: item[k].strip() for k in PRINCIPLE_KEYS})
