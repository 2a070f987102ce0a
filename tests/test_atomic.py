"""Saves are atomic: a save that fails half-way leaves the previous folder exactly as it was."""
import pytest

import zoo
from zoo.atomic import atomic_directory
from tiny import tiny_native


def test_failed_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    model = zoo.convert(tiny_native("mixtral"))
    dest = tmp_path / "m"
    model.save_pretrained(dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def broken_card(*a, **k):
        raise RuntimeError("disk full, say")

    monkeypatch.setattr("zoo.cards.card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(dest)  # weights written to the temp folder, then the card fails
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folder left behind


def test_atomic_directory_replaces_on_success(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic_directory(dest) as tmp:
        (tmp_path / tmp / "new.txt").write_text("new")
    assert [p.name for p in dest.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
