"""The shipped corpus (checksums, whole-document splits) and its byte-level BPE tokenizer."""
import hashlib
import lzma
import shutil

import pytest
import torch

from zoo.data.corpus import (CORPUS_DIR, DOMAINS, SEPARATOR, SPLITS, CorpusChecksumError, load_manifest,
                             load_split, load_text, split_documents, strip_gutenberg)
from zoo.data.tokenizer import EOS, PAD, load_tokenizer

MANIFEST = load_manifest()
TEXT = {(d, s): load_text(d, s) for d in DOMAINS for s in SPLITS}  # also verifies every checksum once


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_every_split_matches_its_manifest_checksum():
    assert set(MANIFEST["splits"]) == {f"{d}/{s}" for d in DOMAINS for s in SPLITS}
    for (domain, split), text in TEXT.items():
        entry = MANIFEST["splits"][f"{domain}/{split}"]
        data = text.encode("utf-8")
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
    assert MANIFEST["sources"]["english"]["sdist_sha256"] and MANIFEST["sources"]["code"]["python"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_splits_are_disjoint_whole_documents(domain):
    entries = {s: MANIFEST["splits"][f"{domain}/{s}"]["documents"] for s in SPLITS}
    names = {s: [d["name"] for d in entries[s]] for s in SPLITS}
    assert not set(names["train"]) & set(names["val"]) and all(len(set(n)) == len(n) for n in names.values())
    sizes = {}
    for split in SPLITS:
        docs = load_split(domain, split)
        assert len(docs) == len(names[split]) and all(doc.strip() and SEPARATOR not in doc for doc in docs)
        assert [len(doc.encode()) for doc in docs] == [d["bytes"] for d in entries[split]]
        assert SEPARATOR.join(docs) == TEXT[domain, split]
        sizes[split] = sum(len(doc.encode()) for doc in docs)
    share = sizes["val"] / (sizes["train"] + sizes["val"])
    print(f"{domain}: {len(names['train'])} train / {len(names['val'])} val documents, val share {share:.1%}")
    assert 0.05 <= share <= 0.10 and len(names["val"]) >= 2


def test_both_domains_are_substantial_and_what_they_claim():
    for domain in DOMAINS:
        assert len(TEXT[domain, "train"]) > 3_000_000 and len(TEXT[domain, "val"]) > 100_000
    english = {d["name"] for s in ("train", "val") for d in MANIFEST["splits"][f"english/{s}"]["documents"]}
    code = {d["name"] for s in ("train", "val") for d in MANIFEST["splits"][f"code/{s}"]["documents"]}
    assert len(english) == 42 and {"hamlet", "sonnets", "tempest"} <= english
    assert all(n.endswith(".py") and not n.startswith(("test/", "idlelib/", "site-packages/")) for n in code)
    assert "Project Gutenberg" not in TEXT["english", "train"] + TEXT["english", "val"]
    assert "To be, or not to be" in TEXT["english", "train"] + TEXT["english", "val"]
    assert TEXT["code", "train"].count("\ndef ") > 1000


def test_split_documents_holds_out_whole_documents_deterministically():
    docs = {f"doc{i}": "x" * (100 + 37 * i) for i in range(60)}
    first, again = split_documents("english", docs), split_documents("english", dict(reversed(docs.items())))
    assert set(first["val"]) == set(again["val"]) and set(first["train"]) | set(first["val"]) == set(docs)
    total = sum(map(len, docs.values()))
    assert 0.06 * total <= sum(len(docs[n]) for n in first["val"]) <= 0.10 * total


def test_strip_gutenberg_keeps_only_the_text():
    raw = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"
           "HAMLET\nWho's there?\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    assert strip_gutenberg(raw).strip() == "HAMLET\nWho's there?"
    assert strip_gutenberg("no markers\n") == "no markers\n"


def test_corrupted_split_fails_the_checksum(tmp_path):
    shutil.copy(CORPUS_DIR / "MANIFEST.json", tmp_path)
    for split in SPLITS:
        shutil.copy(CORPUS_DIR / f"code-{split}.txt.xz", tmp_path)
    assert load_text("code", "val", root=tmp_path) == TEXT["code", "val"]  # an intact copy loads from root=
    with lzma.open(tmp_path / "code-val.txt.xz", "wb") as f:
        f.write(TEXT["code", "val"].replace("def ", "dfe ", 1).encode())  # same length, one edit
    with pytest.raises(CorpusChecksumError, match=r"checksum mismatch for code/val.*corrupt"):
        load_text("code", "val", root=tmp_path)
    with pytest.raises(CorpusChecksumError, match="checksum mismatch"):
        load_split("code", "val", root=tmp_path)
    assert load_split("code", "train", root=tmp_path)  # the untouched split still verifies
    with pytest.raises(ValueError, match="unknown split"):
        load_text("french", "val")


def test_tokenizer_vocab_and_special_tokens(tok):
    assert len(tok) == tok.vocab_size == 8192
    assert tok.eos_token == tok.bos_token == EOS and tok.pad_token == PAD and tok.pad_token_id != tok.eos_token_id
    assert tok.encode("") == [] and tok.encode(EOS) == [tok.eos_token_id]  # no implicit bos/eos added
    assert len(tok.convert_ids_to_tokens(tok.encode("    return self"))) <= 3  # merges learnt from code


TRICKY = ["", " ", "  leading and trailing  ", "a\tb\t\tc", "\n\n\n", "tabs\t\n\tand\r\nCRLF\r\n",
          "multiple     spaces", "unicode: héllo wörld — ∑ x² 日本語 😀 \u200b\u00a0", "nul\x00 and del\x7f",
          "def f(x):\n    return {'a': [1, 2]}  # comment\n", "don't , . ! ? ' \" punctuation  ,spacing",
          f"two{EOS}documents{PAD}", "ﬁ ligature, combining e\u0301, RTL שלום"]


def test_tokenizer_round_trips_tricky_strings(tok):
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == text, repr(text)


@pytest.mark.parametrize("domain", DOMAINS)
def test_tokenizer_round_trips_val_text_and_compresses(tok, domain):
    text = TEXT[domain, "val"]
    for doc in load_split(domain, "val"):
        sample = doc[:5000]
        assert tok.decode(tok.encode(sample)) == sample
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    per_byte = len(ids) / len(text.encode("utf-8"))
    print(f"{domain} val: {len(ids):,} tokens / {len(text.encode()):,} bytes = {per_byte:.3f} tokens per byte")
    assert 0.15 < per_byte < 0.5  # bytes alone would be 1.0; a sane 8k BPE lands near 0.25-0.35


def test_the_out_of_domain_splits_are_text_of_other_origins():
    """Modern English (a licence, Python's language reference) and third-party Python (pluggy, click): nothing of
    the training sources, a different register, and enough of it for 24 windows of 256 tokens per domain."""
    english, code = TEXT["english", "ood"], TEXT["code", "ood"]
    names = {d: [e["name"] for e in MANIFEST["splits"][f"{d}/ood"]["documents"]] for d in DOMAINS}
    assert names["english"][0] == "apache-2.0-licence" and all(n.startswith("python-reference/")
                                                                for n in names["english"][1:])
    assert {n.split("/")[0] for n in names["code"]} == {"pluggy", "click"}
    trained = TEXT["english", "train"] + TEXT["english", "val"] + TEXT["code", "train"] + TEXT["code", "val"]
    for d in DOMAINS:
        for doc in load_split(d, "ood"):
            assert doc[:2000] not in trained  # no document of the training sources
    assert "Apache License" in english and "thou" not in english.lower().split()
    assert code.count("def ") > 200 and "import pluggy" not in TEXT["code", "train"]
    assert min(len(english), len(code)) > 150_000
    for package in ("pluggy", "click"):
        assert package in MANIFEST["sources"]["ood"]["code"]
        assert f"### {package}:" in (CORPUS_DIR / "ATTRIBUTION.md").read_text()  # its licence notice travels


def test_token_streams_are_cached_on_disk_checked_and_never_written_through_a_link(tmp_path, monkeypatch):
    """A stream tokenized once is read back from the disk cache (the same ids, no tokenizing); a cached file that is
    not a stream (ids outside the vocabulary, truncated) is tokenized again and replaced; a link at its name is
    neither read nor written through; MOE_ZOO_CACHE=off writes nothing."""
    import zoo.data.tokens as tokens
    from safetensors.torch import save_file

    monkeypatch.setenv("MOE_ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokens, "_CACHE", {})
    tok = tokens.load_tokenizer()
    want = tokens.token_stream("code", "val", tok)
    [path] = (tmp_path / "cache" / "tokens").iterdir()
    assert path.name.startswith("code-val-")

    calls = []
    real = tokens._tokenize
    monkeypatch.setattr(tokens, "_tokenize", lambda *a: calls.append(a) or real(*a))

    def fresh():
        tokens._CACHE.clear()
        return tokens.token_stream("code", "val", tok)

    assert torch.equal(fresh(), want) and not calls  # read back, not tokenized
    save_file({"ids": torch.full((5,), len(tok), dtype=torch.int32)}, path)  # an id outside the vocabulary
    assert torch.equal(fresh(), want) and len(calls) == 1
    assert torch.equal(fresh(), want) and len(calls) == 1  # replaced by the good stream
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert torch.equal(fresh(), want) and len(calls) == 2

    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not yours")
    path.unlink()
    path.symlink_to(victim)
    assert torch.equal(fresh(), want) and len(calls) == 3
    assert victim.read_bytes() == b"not yours" and path.is_symlink()

    monkeypatch.setenv("MOE_ZOO_CACHE", "off")
    assert torch.equal(fresh(), want) and len(calls) == 4
    assert [p.name for p in (tmp_path / "cache" / "tokens").iterdir()] == [path.name]


def test_a_streams_key_follows_the_tokenizers_vocabulary(monkeypatch):
    """token_stream keys a stream by the tokenizer's vocabulary, hashed once per tokenizer object while its size
    stays (get_vocab builds the whole dict); another object with the same vocabulary gets the same key, a token added
    another one."""
    import copy

    import zoo.data.tokens as tokens

    tok = copy.deepcopy(tokens.load_tokenizer())
    calls, real = [], type(tok).get_vocab
    monkeypatch.setattr(type(tok), "get_vocab", lambda self: calls.append(1) or real(self))
    first = tokens._vocab_hash(tok)
    assert tokens._vocab_hash(tok) == first and len(calls) == 1
    other = copy.deepcopy(tok)
    assert tokens._vocab_hash(other) == first and len(calls) == 2
    other.add_tokens(["<zoo-test-token>"])
    assert tokens._vocab_hash(other) != first and len(calls) == 3
    assert tokens._vocab_hash(tok) == first and len(calls) == 3
