"""Saves that merge into their folder and survive a crash.

A save is written whole into a hidden staging folder inside the destination, then each file is moved into
place with one rename (atomic on POSIX): the weights first, the config next, a weights index last, so a
reader never sees an index naming shards that are not there yet. Files the save does not write are kept (a
tokenizer saved first stays). The one exception is a previous save's weight files that the new save no
longer writes: a stale ``model.safetensors`` would shadow a new sharded index in ``from_pretrained``.
A crash or kill while staging leaves the destination as it was; the next save into it removes the dead
save's staging folder.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

STAGING_PREFIX = ".moe-zoo-staging-"
# the files one model save writes its tensors to (transformers' names for a single file, shards and index)
WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


class SaveTargetError(ValueError):
    """The destination cannot hold a save (a file, or a folder too broad to mean)."""


def check_target(dest) -> Path:
    """``dest`` as a folder path a save may write into, or ``SaveTargetError`` with the reason."""
    raw = os.fspath(dest)
    if raw.strip() in ("", ".", "./"):
        raise SaveTargetError(f"refusing to save into {raw!r}: name the folder (e.g. os.getcwd() for the "
                              "current one)")
    path = Path(raw).expanduser()
    if path.resolve() == Path(path.resolve().anchor):
        raise SaveTargetError(f"refusing to save into the root folder {raw!r}")
    if path.is_symlink() and not path.exists():
        raise SaveTargetError(f"cannot save into {raw!r}: it is a broken symbolic link")
    if path.exists() and not path.is_dir():
        raise SaveTargetError(f"cannot save into {raw!r}: it is a file, not a folder")
    return path


@contextmanager
def atomic_directory(dest):
    """``with atomic_directory(path) as tmp: write into tmp``: on success every file in tmp is moved into
    ``path`` (created if needed; files already there that the save does not write are kept); on any error
    ``path`` is left as it was and tmp is deleted."""
    dest = check_target(dest)
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(dest)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=dest))
    try:
        yield os.fspath(staging)
        _publish(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            _remove_if_empty(dest)
        raise
    shutil.rmtree(staging, ignore_errors=True)


def remove_dead_staging(folder: Path) -> list[str]:
    """Remove staging folders left in ``folder`` by saves whose process is gone; returns their names."""
    removed = []
    for entry in folder.iterdir():
        if not entry.name.startswith(STAGING_PREFIX) or not entry.is_dir():
            continue
        pid = entry.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue  # a concurrent save is still writing it
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _order(name: str) -> int:
    """Weights first, then side files, then the config, the index last."""
    if name.endswith(".index.json"):
        return 3
    if name == "config.json":
        return 2
    return 0 if WEIGHT_FILE.match(name) else 1


def _publish(staging: Path, dest: Path) -> None:
    """Move the staged files into ``dest`` one rename each (subfolders merged the same way)."""
    entries = sorted(staging.iterdir(), key=lambda p: (_order(p.name), p.name))
    for entry in entries:
        if entry.is_dir():
            target = dest / entry.name
            if target.is_dir():
                _publish(entry, target)
                continue
            if target.exists():
                raise SaveTargetError(f"cannot save folder {entry.name!r} into {dest}: a file of that name is there")
            _fsync_tree(entry)
            os.replace(entry, target)
        else:
            _fsync(entry)
            os.replace(entry, dest / entry.name)
    written = {p.name for p in entries}
    if any(WEIGHT_FILE.match(name) for name in written):
        for old in dest.iterdir():
            if old.is_file() and WEIGHT_FILE.match(old.name) and old.name not in written:
                old.unlink()
    _fsync_dir(dest)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory
    finally:
        os.close(fd)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass
