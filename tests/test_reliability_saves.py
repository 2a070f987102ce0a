"""Saves lose nothing: they merge into the folder, refuse targets that cannot be meant, survive a kill."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import zoo
import zoo.editing.stream
from zoo.io.atomic import STAGING_PREFIX, SaveTargetError, atomic_directory
from tiny import tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model():
    return zoo.convert(tiny_native("mixtral"))


def test_tokenizer_saved_first_is_kept(model, tmp_path):
    from zoo.data.tokenizer import load_tokenizer

    load_tokenizer().save_pretrained(tmp_path / "m")
    tokenizer_files = snapshot(tmp_path / "m")
    model.save_pretrained(tmp_path / "m")
    after = snapshot(tmp_path / "m")
    assert {k: after[k] for k in tokenizer_files} == tokenizer_files
    assert "model.safetensors" in after and "config.json" in after


def test_other_files_and_folder_mode_are_kept(model, tmp_path):
    dest = tmp_path / "m"
    dest.mkdir(mode=0o755)
    os.chmod(dest, 0o755)
    (dest / "notes.txt").write_text("mine")
    (dest / "sub").mkdir()
    (dest / "sub" / "data.bin").write_bytes(b"\x00\x01")
    model.save_pretrained(dest)
    assert (dest / "notes.txt").read_text() == "mine"
    assert (dest / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert os.stat(dest).st_mode & 0o777 == 0o755
    assert not [p for p in dest.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_new_folder_gets_the_usual_mode(model, tmp_path):
    umask = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "new")
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "new").st_mode & 0o777 == 0o755


def test_a_file_at_the_target_is_refused_and_kept(model, tmp_path):
    target = tmp_path / "model"
    target.write_text("precious")
    with pytest.raises(SaveTargetError, match="is a file"):
        model.save_pretrained(target)
    assert target.read_text() == "precious"


def test_symlink_to_a_file_is_refused(model, tmp_path):
    (tmp_path / "real.txt").write_text("precious")
    (tmp_path / "link").symlink_to(tmp_path / "real.txt")
    with pytest.raises(SaveTargetError, match="is a file"):
        model.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real.txt").read_text() == "precious"


def test_symlink_to_a_folder_saves_into_it_and_stays(model, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "keep.txt").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    model.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert {"keep.txt", "config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "real").iterdir()}


def test_dangling_symlink_is_refused(model, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SaveTargetError, match="broken symbolic link"):
        model.save_pretrained(tmp_path / "link")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("target", ["", ".", "./", "/"])
def test_targets_too_broad_to_mean_are_refused(model, tmp_path, monkeypatch, target):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SaveTargetError, match="refusing"):
        model.save_pretrained(target)
    assert list(tmp_path.iterdir()) == [] and not list(tmp_path.parent.glob(f"{STAGING_PREFIX}*"))


def test_current_folder_by_its_path_is_allowed(model, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    model.save_pretrained(os.getcwd())
    assert (tmp_path / "here" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["here"]  # nothing written beside it


def test_failed_save_keeps_everything_and_leaves_no_litter(model, tmp_path, monkeypatch):
    dest = tmp_path / "m"
    model.save_pretrained(dest)
    (dest / "tokenizer.json").write_text("{}")
    before = snapshot(dest)

    def broken_card(*a, **k):
        raise RuntimeError("disk full, say")

    monkeypatch.setattr("zoo.publishing.cards.card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(dest)
    assert snapshot(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_failed_first_save_leaves_no_folder(model, tmp_path, monkeypatch):
    monkeypatch.setattr("zoo.publishing.cards.card", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model.save_pretrained(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_stale_single_file_does_not_shadow_a_sharded_save(tmp_path):
    """A previous save's model.safetensors would be read instead of the new index: it is replaced."""
    dest = tmp_path / "m"
    zoo.convert(tiny_native("mixtral", seed=1)).save_pretrained(dest)
    new = zoo.convert(tiny_native("mixtral", seed=2))
    new.save_pretrained(dest, max_shard_size="200KB")
    names = {p.name for p in dest.iterdir()}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    reloaded = AutoModelForCausalLM.from_pretrained(dest)
    for (k, a), b in zip(new.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_fewer_shards_remove_the_old_extra_shards(tmp_path):
    dest = tmp_path / "m"
    model = zoo.convert(tiny_native("mixtral"))
    model.save_pretrained(dest, max_shard_size="100KB")
    many = {p.name for p in dest.glob("model-*.safetensors")}
    model.save_pretrained(dest, max_shard_size="400KB")
    few = {p.name for p in dest.glob("model-*.safetensors")}
    assert len(few) < len(many) and not (many - few) & {p.name for p in dest.iterdir()}


def test_dead_save_staging_is_removed_live_one_kept(model, tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (dest / f"{STAGING_PREFIX}{dead.pid}-abc").mkdir()
    (dest / f"{STAGING_PREFIX}{dead.pid}-abc" / "model.safetensors").write_bytes(b"0" * 100)
    live = f"{STAGING_PREFIX}{os.getppid()}-xyz"
    (dest / live).mkdir()
    model.save_pretrained(dest)
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(STAGING_PREFIX)) == [live]


def test_streamed_convert_and_export_merge(tmp_path):
    native = tiny_native("mixtral")
    native.save_pretrained(tmp_path / "native")
    for out in ("zoo", "back"):
        (tmp_path / out).mkdir()
        (tmp_path / out / "mine.txt").write_text(out)
    zoo.editing.stream.convert(tmp_path / "native", tmp_path / "zoo")
    zoo.editing.stream.export(tmp_path / "zoo", tmp_path / "back")
    for out in ("zoo", "back"):
        assert (tmp_path / out / "mine.txt").read_text() == out
        assert (tmp_path / out / "config.json").is_file()


def test_nested_saves_publish_into_the_outer_staging(model, tmp_path):
    with atomic_directory(tmp_path / "outer") as tmp:
        model.save_pretrained(os.path.join(tmp, "model"))
        assert not (tmp_path / "outer" / "model").exists()  # nothing visible until the outer save ends
    assert (tmp_path / "outer" / "model" / "model.safetensors").is_file()
    assert not list((tmp_path / "outer").glob(f"{STAGING_PREFIX}*"))


KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from transformers import MixtralConfig, MixtralForCausalLM
    import zoo
    from tiny import COMMON
    cfg = MixtralConfig(**{{**COMMON, "vocab_size": 256, "hidden_size": 512}}, intermediate_size=1024,
                        num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = zoo.convert(MixtralForCausalLM(cfg))
    print("built", flush=True)
    model.save_pretrained({dest!r})
""")


def test_kill_during_a_large_save_keeps_the_previous_contents(model, tmp_path):
    """A few-hundred-MB save killed with SIGKILL while writing: the folder is as it was, and the next save
    removes the dead save's staging folder."""
    dest = tmp_path / "m"
    model.save_pretrained(dest)
    (dest / "tokenizer.json").write_text("{}")
    before = snapshot(dest)
    script = KILLED_SAVE.format(tests=os.path.dirname(__file__), dest=os.fspath(dest))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "built"
        deadline = time.time() + 120
        staged = 0
        while time.time() < deadline and staged < 50 * 2**20:  # kill once 50 MB are written
            staged = sum(p.stat().st_size for p in dest.glob(f"{STAGING_PREFIX}*/**/*") if p.is_file())
            time.sleep(0.01)
        assert staged >= 50 * 2**20, "the save never got going"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert snapshot(dest).keys() >= before.keys()
    assert {k: v for k, v in snapshot(dest).items() if not k.startswith(STAGING_PREFIX)} == before
    assert list(dest.glob(f"{STAGING_PREFIX}*"))  # the kill left its staging folder ...
    model.save_pretrained(dest)
    assert not list(dest.glob(f"{STAGING_PREFIX}*"))  # ... which the next save removes
    assert (dest / "tokenizer.json").read_text() == "{}"
