"""Atomic folder writes: everything goes to a sibling temp folder, which then replaces the destination."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager


@contextmanager
def atomic_directory(dest):
    """``with atomic_directory(path) as tmp: write into tmp`` -- on success tmp becomes ``path`` (an old
    ``path`` is swapped out and removed); on any error ``path`` is left as it was and tmp is deleted."""
    dest = os.fspath(dest).rstrip("/")
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(dest):
        old = f"{dest}.old-{os.path.basename(tmp)}"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)
