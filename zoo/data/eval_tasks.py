"""The zoo's own lm-evaluation-harness tasks, made from the held-out splits of the shipped corpus.

Nothing can be downloaded here, so the tasks are built from data the zoo owns (``zoo.data.corpus``, the ``val`` and
``ood`` splits only, never ``train``) and shipped as lm-eval task YAMLs with small JSON-lines files in
``zoo/_data/tasks/``:

- ``zoo_continuation_<domain>`` (multiple choice): a window of held-out text ending at a line break; pick the line
  that really comes next among ``CHOICES - 1`` lines drawn from other documents of the same split (acc, acc_norm,
  and acc_mutual_info, which discounts how likely each line is on its own; chance is ``1 / CHOICES``).
- ``zoo_perplexity_<domain>`` and ``zoo_perplexity_<domain>_ood`` (``loglikelihood_rolling``): passages of whole
  lines of held-out (or out-of-domain) documents (word_perplexity, byte_perplexity, bits_per_byte).

Everything is drawn with ``random.Random`` seeded by a string, so a rebuild gives the same bytes;
``MANIFEST.json`` records each file's sha256 (checked by the tasks' loader, ``local_json.py``) and the corpus
splits it came from. Rebuild with ``python -m zoo.data.eval_tasks build``; ``check`` compares a rebuild with the
shipped files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

from zoo.io.atomic import atomic_file
from zoo.data.corpus import DOMAINS, load_manifest, load_split

TASKS_DIR = Path(__file__).resolve().parent.parent / "_data" / "tasks"
DATA = "data"  # the JSON-lines files, under TASKS_DIR
MANIFEST = "MANIFEST.json"

CHOICES = 4  # the true next line and three distractors: chance is 25%
MC_ITEMS = 100  # per domain
CONTEXT_CHARS = 400  # at most this much context before the line to predict (about 100-150 tokens)
MIN_CONTEXT_CHARS = 200
LINE_CHARS = (25, 100)  # a line to predict (or a distractor) has this many characters once stripped
PASSAGES = 16  # per domain and split
PASSAGE_CHARS = 2000  # whole lines until at least this many characters


def _lines(doc: str) -> list[tuple[int, str]]:
    """``(offset, line)`` for every line of ``doc`` (without its newline)."""
    out, at = [], 0
    for line in doc.split("\n"):
        out.append((at, line))
        at += len(line) + 1
    return out


def _predictable(line: str) -> bool:
    return LINE_CHARS[0] <= len(line.strip()) <= LINE_CHARS[1]


def _context(doc: str, end: int) -> str | None:
    """The text before offset ``end`` (a line start), at most ``CONTEXT_CHARS`` long and starting at a line start;
    None when there is too little."""
    start = doc.find("\n", max(0, end - CONTEXT_CHARS) - 1) + 1 if end > CONTEXT_CHARS else 0
    text = doc[start:end]
    return text if len(text.strip()) >= MIN_CONTEXT_CHARS else None


def continuation_items(domain: str, split: str = "val", n: int = MC_ITEMS) -> list[dict]:
    """``n`` multiple-choice items ``{context, choices, label, source, offset}`` from ``domain``'s ``split``."""
    docs = load_split(domain, split)
    names = [d["name"] for d in load_manifest()["splits"][f"{domain}/{split}"]["documents"]]
    if len(docs) < 2:
        raise ValueError(f"{domain}/{split} has {len(docs)} document(s): distractors need another document")
    rng = random.Random(f"moe-zoo/continuation/{domain}/{split}")
    lines = [[(at, line) for at, line in _lines(doc) if _predictable(line)] for doc in docs]
    targets = [(i, at, line) for i, doc in enumerate(docs) for at, line in lines[i] if _context(doc, at)]
    items = []
    for i, at, line in sorted(rng.sample(targets, n)):
        context = _context(docs[i], at)
        taken = {line.strip()}
        distractors = []
        while len(distractors) < CHOICES - 1:
            j = rng.choice([k for k in range(len(docs)) if k != i])
            _, other = rng.choice(lines[j])
            # never a line that could be right too: one equal to another choice or found in the context
            if other.strip() not in taken and other.strip() not in context:
                taken.add(other.strip())
                distractors.append(other)
        label = rng.randrange(CHOICES)
        items.append({"context": context, "choices": distractors[:label] + [line] + distractors[label:],
                      "label": label, "source": names[i], "offset": at})
    return items


def passages(domain: str, split: str, n: int = PASSAGES) -> list[dict]:
    """``n`` passages ``{text, source, offset}`` of whole lines (at least ``PASSAGE_CHARS`` characters each) from
    ``domain``'s ``split``, in corpus order; each document is cut into consecutive passages, so none overlap."""
    docs = load_split(domain, split)
    names = [d["name"] for d in load_manifest()["splits"][f"{domain}/{split}"]["documents"]]
    pieces = []
    for i, doc in enumerate(docs):
        start = 0
        for at, line in _lines(doc):
            end = at + len(line)
            if end - start >= PASSAGE_CHARS and doc[start:end].strip():
                pieces.append((i, start, doc[start:end]))
                start = end + 1
    rng = random.Random(f"moe-zoo/perplexity/{domain}/{split}")
    chosen = sorted(rng.sample(range(len(pieces)), min(n, len(pieces))))
    return [{"text": pieces[k][2], "source": names[pieces[k][0]], "offset": pieces[k][1]} for k in chosen]


def task_files() -> dict[str, list[dict]]:
    """``{file name: rows}`` of every task's data."""
    files = {f"continuation_{d}_val.jsonl": continuation_items(d, "val") for d in DOMAINS}
    files |= {f"perplexity_{d}_{s}.jsonl": passages(d, s) for d in DOMAINS for s in ("val", "ood")}
    return files


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode("utf-8")


def _write(path: Path, data: bytes) -> None:
    with atomic_file(path, overwrite=True) as staged:
        Path(staged).write_bytes(data)


def build(out_dir: str | Path = TASKS_DIR) -> dict:
    """Write the data files and ``MANIFEST.json`` under ``out_dir`` (the YAMLs and loader stay as they are)."""
    out = Path(out_dir)
    (out / DATA).mkdir(parents=True, exist_ok=True)
    corpus = load_manifest()["splits"]
    manifest = {"builder": "python -m zoo.data.eval_tasks build",
                "corpus": {k: corpus[k]["sha256"] for k in sorted(corpus) if not k.endswith("/train")},
                "files": {}}
    for name, rows in task_files().items():
        data = _jsonl(rows)
        _write(out / DATA / name, data)
        manifest["files"][f"{DATA}/{name}"] = {"rows": len(rows), "bytes": len(data),
                                               "sha256": hashlib.sha256(data).hexdigest()}
    _write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def check(tasks_dir: str | Path = TASKS_DIR) -> list[str]:
    """The shipped files that a rebuild would change (empty when the shipped tasks are what the builder makes)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(tmp)
    shipped = json.loads((Path(tasks_dir) / MANIFEST).read_text())
    names = sorted(set(fresh["files"]) | set(shipped["files"]))
    differ = [n for n in names if fresh["files"].get(n) != shipped["files"].get(n)]
    return differ + (["corpus"] if fresh["corpus"] != shipped["corpus"] else [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zoo.data.eval_tasks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="regenerate the task data files and MANIFEST.json").add_argument(
        "out_dir", nargs="?", default=str(TASKS_DIR))
    sub.add_parser("check", help="rebuild in a temporary folder and compare with the shipped files")
    args = parser.parse_args(argv)
    if args.command == "check":
        differ = check()
        print("the shipped task data is what the builder makes" if not differ else f"differs: {', '.join(differ)}")
        sys.exit(1 if differ else 0)
    for name, entry in build(args.out_dir)["files"].items():
        print(f"{name:36s} {entry['rows']:4d} rows {entry['bytes']:>8,d} bytes  {entry['sha256'][:16]}")


if __name__ == "__main__":
    main()
