"""Token streams of the shipped corpus, and the batches training and evaluation draw from them.

Tokenizing a train split takes seconds (about 7 s for both domains on this project's 2-core machine), paid by every
process that calibrates or evaluates on the corpus. A stream is kept in memory per process and on disk in the user's
cache (``$MOE_ZOO_CACHE``, else ``$XDG_CACHE_HOME/moe-zoo`` or ``~/.cache/moe-zoo``; ``MOE_ZOO_CACHE=off`` turns the
disk cache off), under a name that hashes what decides the ids: the split's checksum from the corpus manifest, the
tokenizer's full serialisation and the separator. A cached file is read back checked (one 1-D int32 tensor, ids
inside the vocabulary), else tokenized again; it is written through the atomic saver, never over another file.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import weakref
from pathlib import Path

import torch

from zoo.data.corpus import CORPUS_DIR, DOMAINS, SEPARATOR, load_manifest, load_text
from zoo.data.tokenizer import load_tokenizer

_CACHE: dict[tuple, torch.Tensor] = {}
_VOCAB_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, _vocab_hash)
FORMAT = 1  # bump when the way a stream is made changes


def token_stream(domain: str, split: str, tokenizer=None) -> torch.Tensor:
    """The whole split as one 1-D tensor of token ids (documents separated by eos), cached per tokenizer."""
    tok = tokenizer or load_tokenizer()
    key = (domain, split, _vocab_hash(tok))  # two tokenizers never share a stream
    if key not in _CACHE:
        disk = _disk_path(domain, split, tok)
        ids = _read(disk, len(tok)) if disk is not None else None
        if ids is None:
            ids = _tokenize(domain, split, tok)
            if disk is not None:
                _write(disk, ids)
        _CACHE[key] = ids
    return _CACHE[key]


def _vocab_hash(tok) -> int:
    """A hash of the tokenizer's vocabulary, remembered per tokenizer object while its size stays: ``get_vocab``
    builds the whole dict (~4 ms a call), and evaluation asks for a stream per batch (621 calls, 2.5 s, in the claim
    scripts' quick runs). A tokenizer that cannot be weakly referenced is hashed on every call."""
    size = len(tok)
    try:
        known = _VOCAB_HASHES.get(tok)
    except TypeError:
        known = None
    if known is not None and known[0] == size:
        return known[1]
    value = hash(frozenset(tok.get_vocab().items()))
    with contextlib.suppress(TypeError):
        _VOCAB_HASHES[tok] = (size, value)
    return value


def _tokenize(domain: str, split: str, tok) -> torch.Tensor:
    # document by document: the same ids as the whole text at once (the separator is a special token, so
    # no merge crosses it), at a fraction of the tokenizer's peak memory (1.4 GB -> 0.6 GB on the train split)
    sep = tok(SEPARATOR)["input_ids"]
    ids: list[int] = []
    for i, doc in enumerate(load_text(domain, split).split(SEPARATOR)):
        ids += (sep if i else []) + tok(doc)["input_ids"]
    return torch.tensor(ids, dtype=torch.int32)


def cache_dir() -> Path | None:
    """Where token streams are kept on disk, or None when ``MOE_ZOO_CACHE=off``."""
    root = os.environ.get("MOE_ZOO_CACHE")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-zoo"
    return Path(root).expanduser() / "tokens"


def _disk_path(domain: str, split: str, tok) -> Path | None:
    folder = cache_dir()
    backend = getattr(tok, "backend_tokenizer", None)
    if folder is None or backend is None:  # a slow tokenizer has no full serialisation to name its streams by
        return None
    checksum = load_manifest(CORPUS_DIR)["splits"][f"{domain}/{split}"]["sha256"]
    digest = hashlib.sha256(f"{FORMAT}\0{checksum}\0{SEPARATOR}\0{backend.to_str()}".encode()).hexdigest()
    return folder / f"{domain}-{split}-{digest[:32]}.safetensors"


def _read(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The cached stream, or None where there is none or it is not one (wrong dtype or shape, ids outside the
    vocabulary, an unreadable file): then the split is tokenized again."""
    from safetensors.torch import load_file

    if not path.is_file() or path.is_symlink():
        return None
    try:
        ids = load_file(path).get("ids")
    except Exception:  # noqa: BLE001 - a truncated or foreign file is only a cache miss
        return None
    if ids is None or ids.dtype != torch.int32 or ids.dim() != 1 or ids.numel() == 0:
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return None
    return ids


def _write(path: Path, ids: torch.Tensor) -> None:
    """Best effort: a cache that cannot be written (read-only home, a file already there) is skipped."""
    from safetensors.torch import save_file

    from zoo.io.atomic import atomic_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        overwrite = path.is_file() and not path.is_symlink()  # only a stale or broken stream of this very name
        with atomic_file(path, overwrite=overwrite) as tmp:
            save_file({"ids": ids.contiguous()}, tmp)
    except (OSError, ValueError):  # ValueError: the saver's refusal of a target it must not write
        pass


def train_batch(streams: dict[str, torch.Tensor], step: int, batch_size: int, seq_len: int, seed: int = 0):
    """Random windows, half from each domain; a pure function of (seed, step) so runs resume exactly
    and two models trained with the same seed see the same tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = []
    for i in range(batch_size):
        stream = streams[DOMAINS[i % len(DOMAINS)]]
        start = int(torch.randint(0, len(stream) - seq_len, (1,), generator=g))
        rows.append(stream[start:start + seq_len])
    return torch.stack(rows).long()


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows from the start of a held-out stream (deterministic)."""
    n = len(stream) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * seq_len].view(n, seq_len).long()
