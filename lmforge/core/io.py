"""File helpers shared by every stage: atomic writes, hashing, glob expansion."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


class InputError(ValueError):
    """Bad user input (a file, a record); the message names the file and, where known, the line."""


# Every temporary file or folder a write fills before renaming it into place is a hidden
# sibling named ".<name>." + 8 characters of [a-z0-9_] (tempfile's) + ".tmp".
TEMPORARY_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def is_temporary(path: str | Path) -> bool:
    """Whether ``path`` is a temporary file or folder of an unfinished write (never a symbolic link)."""
    path = Path(path)
    return TEMPORARY_NAME.fullmatch(path.name) is not None and not path.is_symlink()


def remove_temporaries(directory: str | Path, of: str | None = None) -> list[Path]:
    """Remove the temporary files and folders that unfinished writes (a killed run's) left in
    ``directory``, or only those of writes to ``directory/of``; return them. Call it only
    where no write can be under way, at the start of the run that owns them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    own = re.compile(re.escape(f".{of}.") + r"[a-z0-9_]{8}\.tmp") if of is not None else TEMPORARY_NAME
    found = sorted(p for p in directory.iterdir() if own.fullmatch(p.name) and is_temporary(p))
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def temporary_file(path: str | Path) -> tuple[int, Path]:
    """A new empty sibling of ``path`` (hidden, with the usual permissions), open as a descriptor,
    to fill and then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600
    return fd, Path(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    fd, tmp = temporary_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_npy(path: str | Path, array) -> None:
    """``np.save`` of ``array`` to ``path``, atomically (as ``atomic_write_bytes``)."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``path`` only if the block succeeds."""
    tmp = temporary_directory(path)
    try:
        yield tmp
        replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_directory(path: str | Path) -> Path:
    """A new empty sibling of ``path`` (hidden, with the usual permissions) to fill and then
    move into place with ``replace_directory``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the filesystem cannot."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    except (AttributeError, OSError):  # no renameat2 in this C library
        return False


def replace_directory(tmp: str | Path, path: str | Path) -> None:
    """Rename ``tmp`` to ``path``. An existing ``path`` is swapped with ``tmp`` in one step where
    the system can (Linux), so ``path`` is always the old directory or the new one, and the old
    one is removed after; elsewhere it is moved aside to ``.<name>.old`` first, which leaves a
    moment without ``path``."""
    tmp, path = Path(tmp), Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):  # never swap a user's file or link aside
        raise InputError(f"{path}: exists and is not a folder (a file or a link); it is left as it is: "
                         "move it, or write to another folder")
    if not path.exists():
        tmp.rename(path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the old directory
    else:
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)


def named_paths(value: Any, skip_keys: tuple[str, ...] = ()) -> list[Path]:
    """Existing files and folders named by the strings of a config value (dicts and lists
    walked, globs expanded), except values under ``skip_keys``. Any string that happens to
    name a path counts: callers use this to notice when what a config reads has changed."""
    found: list[Path] = []

    def visit(item: Any, key: str) -> None:
        if isinstance(item, dict):
            for k, v in item.items():
                visit(v, k)
        elif isinstance(item, (list, tuple)):
            for v in item:
                visit(v, key)
        elif isinstance(item, str) and item and key not in skip_keys:
            matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
            found.extend(Path(m) for m in matches if Path(m).exists())

    visit(value, "")
    return found


def file_stamps(paths: list[Path], exclude: tuple[Path, ...] | list[Path] = (), identity: bool = False) -> list[tuple]:
    """(path, size, mtime_ns) of every file under ``paths`` (folders walked in sorted order),
    leaving out ``exclude`` and what is under it: one ``stat`` per file, and it changes when a
    file does. A file gone while walking stamps as (path, None, None). ``identity`` adds the
    device, inode and ctime, which a write changes even when the size and mtime are put back
    (``cp -p``, ``os.utime``)."""
    skip = {os.path.realpath(p) for p in exclude}
    stamps = []

    def stamp(path: str) -> None:
        if os.path.realpath(path) in skip:
            return
        try:
            st = os.stat(path)
        except OSError:  # a dangling link, or removed while walking
            stamps.append((path, None, None))
            return
        stamps.append((path, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns) if identity
                      else (path, st.st_size, st.st_mtime_ns))

    for root in map(str, paths):
        if not os.path.isdir(root):
            stamp(root)
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if os.path.realpath(os.path.join(folder, d)) not in skip)
            for name in sorted(files):
                stamp(os.path.join(folder, name))
    return stamps


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def expand_paths(patterns: list[str], *, what: str = "input") -> list[Path]:
    """Expand glob patterns (``**`` allowed) in order; a pattern that matches nothing is an error."""
    if not patterns:
        raise InputError(f"no {what} paths configured")
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files = [Path(m) for m in matches if Path(m).is_file()]
        if not files:
            raise InputError(f"{what} path {pattern!r} matches no file (working directory: {os.getcwd()})")
        for p in files:
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


@contextmanager
def reading(path: str | Path, what: str = "checkpoint file") -> Iterator[None]:
    """Any error while parsing ``path`` inside the block is an ``InputError`` naming it: a file
    truncated or damaged under a checksum that matches it (one rewritten after the damage)."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:  # the parsers' own: JSONDecodeError, SafetensorError, torch.load's RuntimeError ...
        raise InputError(f"{path}: unreadable {what} ({type(exc).__name__}: {exc}); it is truncated or "
                         f"corrupted") from exc


def read_json(path: str | Path, what: str = "file") -> Any:
    """Parse a JSON file; a missing or malformed one is an ``InputError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: not found ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from exc


def check_output_dir(path: str | Path, key: str) -> Path:
    """``path`` when a folder can be made there and written into, else ``InputError`` naming
    ``key``: checked before any work, so a run does not compute everything and then fail to save.
    The test is real and leaves nothing: a file is created and removed in the nearest folder
    that exists (``path`` itself, or the parent it would be made in)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{key} = {path}: exists and is not a folder; choose a folder (new or existing)")
    _probe_nearest_folder(path, path, key)
    return path


def _probe_nearest_folder(folder: Path, named: Path, key: str) -> None:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{key} = {named}: {existing} is a file, so no folder can be made under it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".lmforge-probe.", suffix=".tmp", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{key} = {named}: cannot write in {existing} ({exc.strerror or exc})") from exc


def check_output_file(path: str | Path, key: str) -> Path:
    """``path`` when a file can be written there (its folder made and writable, and ``path``
    not a folder or a read-only file), else ``InputError`` naming ``key``."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{key} = {path}: is a folder; give a file name")
    if path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        raise InputError(f"{key} = {path}: exists and cannot be replaced (not a regular, writable file)")
    _probe_nearest_folder(path.parent, path, key)
    return path
