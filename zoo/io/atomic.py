"""Saves that merge into their folder and survive a crash.

A save is written whole into a hidden staging folder inside the destination, then each file is moved into
place with one rename (atomic on POSIX): the weights first, the config next, a weights index last, so a
reader never sees an index naming shards that are not there yet. Files the save does not write are kept (a
tokenizer saved first stays, and so does a README.md that is not a moe-zoo card). The one exception is a previous save's weight files that the new save no
longer writes: a stale ``model.safetensors`` would shadow a new sharded index in ``from_pretrained``.
A crash or kill while staging leaves the destination as it was; the next save into it removes the dead
save's staging folder.

One file (a GGUF export, a plot, a JSON record) goes the same way through ``atomic_file``: staged in a new hidden
file beside the target (created exclusively, so never a user's file and never through a symbolic link), then
published with one link or rename. Without ``overwrite`` it never replaces anything at the target, not even a
dangling link; with it, the target's directory entry is replaced (a link at the target is replaced, never written
through).

``check_apart(source, out)`` refuses an output that is its input's folder or lies inside it (a fine-tune saved
into its base, a merge into its adapter), before any work.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
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
    """Remove staging folders and files left in ``folder`` by saves whose process is gone (names that only the
    zoo's writers make); returns their names."""
    removed = []
    for entry in Path(folder).iterdir():
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink():
            continue
        pid = entry.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue  # a concurrent save is still writing it (or the name is not one the zoo made)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def check_new_file(path, overwrite: bool = False) -> Path:
    """``path`` as a file a write may create: its folder exists, it is not a folder, and (unless ``overwrite``)
    nothing is there, not even a symbolic link. ``FileExistsError`` / ``SaveTargetError`` / ``FileNotFoundError``
    with the reason otherwise."""
    raw = os.fspath(path)
    if not raw.strip():
        raise SaveTargetError("no output file given")
    path = Path(raw).expanduser()
    if path.is_dir():
        raise SaveTargetError(f"{raw!r} is a folder: name a file in it")
    if os.path.lexists(path) and not overwrite:
        what = "a symbolic link" if path.is_symlink() else "a file"
        raise FileExistsError(f"{raw!r} exists ({what}): the zoo does not replace it (remove it, or name another)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {raw!r}: there is no folder {os.fspath(path.parent)!r}")
    return path


@contextmanager
def atomic_file(path, overwrite: bool = False):
    """``with atomic_file(path) as tmp: write the file tmp``: on success tmp becomes ``path`` in one step; on any
    error ``path`` is as it was and tmp is gone. Without ``overwrite`` an existing ``path`` (file or link) is
    refused before the body runs, and again at the end if one appeared meanwhile (nothing is replaced)."""
    path = check_new_file(path, overwrite)
    remove_dead_staging(path.parent)
    fd, staged = tempfile.mkstemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", suffix=f"-{path.name}", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from every other user and service
    except (AttributeError, OSError):  # no fchmod (Windows): the platform's default
        pass
    os.close(fd)
    try:
        yield staged
        _fsync(Path(staged))
        if os.path.isdir(path):
            raise SaveTargetError(f"{os.fspath(path)!r} became a folder while it was written")
        if overwrite:
            os.replace(staged, path)
        else:
            _link_new(staged, path)
        _fsync_dir(path.parent)
    finally:
        Path(staged).unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else set and restored at once."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _link_new(staged: str, path: Path) -> None:
    """``staged`` at ``path`` without replacing anything there (a hard link fails if the name exists)."""
    try:
        os.link(staged, path, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(f"{os.fspath(path)!r} appeared while it was written: the zoo does not replace it") \
            from None
    except OSError:  # a file system without hard links: check, then rename (a narrow race remains)
        if os.path.lexists(path):
            raise FileExistsError(f"{os.fspath(path)!r} exists: the zoo does not replace it") from None
        os.rename(staged, path)


def write_text(path, text: str, overwrite: bool = False) -> Path:
    """``text`` written to ``path`` through ``atomic_file``."""
    with atomic_file(path, overwrite) as tmp:
        Path(tmp).write_text(text)
    return Path(path)


def check_apart(source, out, what: str = "the output") -> None:
    """``SaveTargetError`` when ``out`` is the folder ``source`` or lies inside it: writing there would change the
    input (its files replaced or joined by the output's). Both are compared as resolved real paths."""
    if source is None or out is None or not os.path.isdir(os.fspath(source)):
        return
    src = Path(os.fspath(source)).expanduser().resolve()
    dst = Path(os.fspath(out)).expanduser().resolve()
    if dst == src or src in dst.parents:
        where = "is" if dst == src else "lies inside"
        raise SaveTargetError(f"{what} {os.fspath(out)!r} {where} the input folder {os.fspath(source)!r}: writing "
                              "there would change the input; name a folder outside it")


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


def _check_fits(staging: Path, dest: Path) -> None:
    """Before anything moves: every staged file lands where no folder is, and every staged folder where no file is
    (a save that failed halfway through publishing would leave new weights beside an old config)."""
    for entry in staging.iterdir():
        target = dest / entry.name
        if entry.is_dir() and target.is_dir() and not target.is_symlink():
            _check_fits(entry, target)
        elif entry.is_dir() and os.path.lexists(target):
            raise SaveTargetError(f"cannot save folder {entry.name!r} into {dest}: a file of that name is there")
        elif not entry.is_dir() and target.is_dir() and not target.is_symlink():
            raise SaveTargetError(f"cannot save {entry.name!r} into {dest}: a folder of that name is there")


def _publish(staging: Path, dest: Path, checked: bool = False) -> None:
    """Move the staged files into ``dest`` one rename each (subfolders merged the same way)."""
    if not checked:
        _check_fits(staging, dest)
    entries = sorted(staging.iterdir(), key=lambda p: (_order(p.name), p.name))
    for entry in entries:
        if entry.is_dir():
            target = dest / entry.name
            if target.is_dir() and not target.is_symlink():
                _publish(entry, target, checked=True)
                continue
            _fsync_tree(entry)
            os.replace(entry, target)
        elif entry.name == "README.md" and _foreign_readme(dest / entry.name):
            warnings.warn(f"kept the README.md already in {dest} (not a moe-zoo model card): the card was not "
                          "written over it; zoo.card(model).save(path) writes it elsewhere", stacklevel=4)
        else:
            _fsync(entry)
            os.replace(entry, dest / entry.name)
    written = {p.name for p in entries}
    if any(WEIGHT_FILE.match(name) for name in written):
        for old in dest.iterdir():
            if old.is_file() and WEIGHT_FILE.match(old.name) and old.name not in written:
                old.unlink()
    _fsync_dir(dest)


def _foreign_readme(path: Path) -> bool:
    """A README.md at ``path`` that is not a card the zoo wrote (its front matter names moe-zoo): a user's, which a
    save keeps. A link is never written through, so it counts as foreign too."""
    if path.is_symlink():
        return True
    if not path.is_file():
        return False
    try:
        head = path.read_text(errors="replace")[:4096]
    except OSError:
        return True
    front = head.split("\n---", 1)[0] if head.startswith("---") else ""
    return "moe-zoo" not in front


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
