"""One writer: every file the zoo writes is staged where no user file can be, never written through a link, never
put over a file the call did not promise to replace; an output that is its input's folder (or inside it) is
refused before any work, and the input stays byte for byte."""
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import zoo
from cli_checks import fails
from tiny import tiny_native
from zoo.io.atomic import STAGING_PREFIX, SaveTargetError, atomic_file, check_apart, write_text
from zoo.cli import cli
from zoo.io.gguf_export import NotGGUFExportable, export_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else
                                               os.readlink(p) if p.is_symlink() else None)
            for p in sorted(Path(folder).rglob("*"))}


@pytest.fixture(scope="module")
def model():
    return zoo.convert(tiny_native("mixtral")).eval()


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "m"
    model.save_pretrained(folder)
    return folder


# ---- atomic_file ---------------------------------------------------------------------------------------------
def test_atomic_file_never_replaces_without_overwrite(tmp_path):
    target = tmp_path / "x.json"
    target.write_text("mine")
    with pytest.raises(FileExistsError, match="does not replace"):
        write_text(target, "theirs")
    assert target.read_text() == "mine"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="symbolic link"):
        write_text(dangling, "theirs")
    assert not (tmp_path / "nowhere").exists()  # not created through the link
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_atomic_file_overwrite_replaces_the_link_not_its_target(tmp_path):
    (tmp_path / "precious").write_text("mine")
    (tmp_path / "out.json").symlink_to(tmp_path / "precious")
    write_text(tmp_path / "out.json", "new", overwrite=True)
    assert (tmp_path / "precious").read_text() == "mine"
    assert not (tmp_path / "out.json").is_symlink() and (tmp_path / "out.json").read_text() == "new"


def test_atomic_file_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "x.bin") as staged:
            Path(staged).write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_a_file_appearing_meanwhile_is_not_replaced(tmp_path):
    with pytest.raises(FileExistsError, match="appeared"):
        with atomic_file(tmp_path / "x.bin") as staged:
            Path(staged).write_bytes(b"ours")
            (tmp_path / "x.bin").write_text("theirs")
    assert (tmp_path / "x.bin").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_dead_staging_files_only_are_removed(tmp_path):
    dead = tmp_path / f"{STAGING_PREFIX}999999999-abc-x.gguf"
    dead.write_bytes(b"left by a killed export")
    mine = tmp_path / f"{STAGING_PREFIX}notes.txt"  # the prefix without a process id: not a name the zoo makes
    mine.write_text("mine")
    write_text(tmp_path / "y.json", "{}")
    assert not dead.exists() and mine.read_text() == "mine"


def test_check_apart(tmp_path):
    (tmp_path / "src" / "sub").mkdir(parents=True)
    for out in (tmp_path / "src", tmp_path / "src" / "sub", tmp_path / "src" / "new", tmp_path / "src" / "."):
        with pytest.raises(SaveTargetError, match="input folder"):
            check_apart(tmp_path / "src", out)
    check_apart(tmp_path / "src", tmp_path / "other")
    check_apart(tmp_path / "src", tmp_path)  # the parent: the input stays a folder of its own
    (tmp_path / "link").symlink_to(tmp_path / "src")
    with pytest.raises(SaveTargetError):
        check_apart(tmp_path / "src", tmp_path / "link" / "out")


# ---- GGUF ------------------------------------------------------------------------------------------------------
def test_gguf_keeps_a_users_partial_file_and_never_writes_through_a_link(model, tmp_path):
    (tmp_path / "m.gguf.partial").write_text("my notes")
    (tmp_path / "target").write_text("precious")
    (tmp_path / "n.gguf.partial").symlink_to(tmp_path / "target")
    export_gguf(model, tmp_path / "m.gguf", progress=False)
    export_gguf(model, tmp_path / "n.gguf", progress=False)
    assert (tmp_path / "m.gguf.partial").read_text() == "my notes"
    assert (tmp_path / "target").read_text() == "precious" and (tmp_path / "n.gguf.partial").is_symlink()
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF" and (tmp_path / "n.gguf").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


@pytest.mark.parametrize("kind", ["file", "link", "dangling"])
def test_export_gguf_refuses_an_existing_target_like_zoo_export(model, tmp_path, kind):
    (tmp_path / "real").write_text("precious")
    target = tmp_path / "m.gguf"
    if kind == "file":
        target.write_text("precious")
    else:
        target.symlink_to(tmp_path / ("real" if kind == "link" else "nowhere"))
    before = snapshot(tmp_path)
    for call in (lambda: export_gguf(model, target, progress=False), lambda: zoo.export(model, target, format="gguf")):
        with pytest.raises(FileExistsError, match="does not replace"):
            call()
    assert snapshot(tmp_path) == before


def test_gguf_refusal_leaves_no_file(model, tmp_path):
    sigmoid = zoo.apply(zoo.convert(tiny_native("mixtral")), "sigmoid-bias")  # a router llama.cpp's llama cannot run
    with pytest.raises(NotGGUFExportable):
        export_gguf(sigmoid, tmp_path / "x.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_gguf_of_one_expert_says_one_used(tmp_path):
    import gguf

    one = zoo.apply(zoo.convert(tiny_native("mixtral")), "prune-frequency", num_experts=1,
                    calibration=[torch.randint(3, 128, (2, 16))])
    export_gguf(one, tmp_path / "one.gguf", progress=False)
    fields = gguf.GGUFReader(tmp_path / "one.gguf").fields
    count = fields["llama.expert_count"].contents()
    used = fields["llama.expert_used_count"].contents()
    assert (count, used) == (1, 1)


def test_gguf_vocabulary_is_the_embeddings_not_a_larger_tokenizers(tmp_path):
    """A model of 128 token ids beside the zoo's 8192-token tokenizer: refused, not a file whose vocabulary is 64
    times its embedding."""
    from zoo.data.tokenizer import load_tokenizer

    folder = tmp_path / "m"
    zoo.convert(tiny_native("mixtral")).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    model = zoo.load(folder)
    with pytest.raises(NotGGUFExportable, match="8192 tokens but the model's embedding has 128 rows"):
        export_gguf(model, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


# ---- outputs that overlap their inputs ---------------------------------------------------------------------------
@pytest.fixture
def adapter(tmp_path):
    """A saved zoo base model (its own tokenizer) and a lora-experts adapter fine-tuned on it, in two folders."""
    from zoo.data.tokenizer import load_tokenizer
    from zoo.training.finetune import finetune

    from transformers import MixtralConfig
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=8192, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    from transformers import MixtralForCausalLM
    base = tmp_path / "base"
    zoo.convert(MixtralForCausalLM(cfg).eval()).save_pretrained(base)
    load_tokenizer().save_pretrained(base)
    finetune(str(base), "lora-experts", {"r": 2}, domain="code", steps=1, batch_size=1, seq_len=16, windows=1,
             out=str(tmp_path / "ad"), progress=False, bf16=False)
    return base, tmp_path / "ad"


def test_finetune_and_merge_never_write_into_their_inputs(adapter, tmp_path, monkeypatch):
    import zoo.training.finetune as ft

    base, ad = adapter
    kept = snapshot(tmp_path)
    monkeypatch.setattr(ft, "held_out", lambda *a, **k: (_ for _ in ()).throw(AssertionError("work ran")))
    for out in (base, base / "sub"):
        fails(["finetune", str(base), "--adapter", "lora-experts:r=2", "--domain", "code", "--steps", "1",
               "--out", str(out)], "input folder")
        with pytest.raises(SaveTargetError, match="input folder"):
            ft.finetune(str(base), "lora-experts", {"r": 2}, domain="code", steps=1, out=str(out))
    with pytest.raises(SaveTargetError, match="input folder"):  # an adapter fine-tuned again, into itself
        ft.finetune(str(ad), "lora-experts", {"r": 2}, domain="code", steps=1, out=str(ad))
    for out in (ad, ad / "merged", base):  # into the adapter, or into its base (the adapter would apply twice)
        fails(["merge", str(ad), str(out)], "input folder")
    assert snapshot(tmp_path) == kept
    res = CliRunner().invoke(cli, ["merge", str(ad), str(tmp_path / "merged")])
    assert res.exit_code == 0, res.output
    merged = zoo.load(tmp_path / "merged")
    ids = torch.randint(3, 8192, (1, 12))
    with torch.no_grad():
        want = zoo.load(ad)(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("command", ["convert", "apply", "export"])
def test_convert_apply_export_refuse_their_own_folder(saved, command):
    kept = snapshot(saved)
    for out in (saved, saved / "inside"):
        args = {"convert": ["convert", str(saved), str(out)],
                "apply": ["apply", str(saved), "topk-softmax:top_k=1", "--out", str(out)],
                "export": ["export", str(saved), str(out)]}[command]
        fails(args, "input folder")
    assert snapshot(saved) == kept


def test_library_calls_refuse_their_own_folder(saved):
    import zoo.editing.stream

    kept = snapshot(saved)
    with pytest.raises(SaveTargetError, match="input folder"):
        zoo.export(zoo.load(saved), saved)
    for call in (lambda: zoo.editing.stream.convert(saved, saved), lambda: zoo.editing.stream.export(saved, saved / "x"),
                 lambda: zoo.editing.stream.apply(saved, [("topk-softmax", {"top_k": 1})], saved)):
        with pytest.raises(SaveTargetError, match="input folder"):
            call()
    assert snapshot(saved) == kept
    zoo.load(saved).save_pretrained(saved)  # saving a model where it came from is a save, as in transformers
    assert (saved / "model.safetensors").is_file()


def test_eval_plot_never_replaces_a_file(saved, tmp_path):
    (tmp_path / "usage.png").write_text("precious")
    fails(["eval", str(saved), "--plot", str(tmp_path / "usage.png"), "--windows", "1", "--no-speed"], "exists")
    assert (tmp_path / "usage.png").read_text() == "precious"


def test_claims_file_is_replaced_whole_never_through_a_link(tmp_path):
    from zoo.evaluation import claims

    folder = tmp_path / "docs" / "claims"
    folder.mkdir(parents=True)
    (tmp_path / "precious").write_text("mine")
    (folder / "demo.json.tmp").symlink_to(tmp_path / "precious")  # the old fixed temporary name
    claims.record("demo", "a claim", "holds", "it does", {"x": 1}, "python x.py", "zoo-tiny-moe", root=tmp_path)
    assert (tmp_path / "precious").read_text() == "mine"
    assert json.loads((folder / "demo.json").read_text())["claims"][0]["verdict"] == "holds"


def test_a_users_readme_is_kept_a_zoo_card_is_replaced(model, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "README.md").write_text("# my project\n\nnotes I wrote\n")
    with pytest.warns(UserWarning, match="kept the README.md"):
        model.save_pretrained(folder)
    assert (folder / "README.md").read_text() == "# my project\n\nnotes I wrote\n"
    assert (folder / "model.safetensors").is_file()
    other = tmp_path / "n"
    model.save_pretrained(other)
    card = (other / "README.md").read_text()
    model.save_pretrained(other)  # the zoo's own card: a save renews it
    assert (other / "README.md").read_text() == card and "moe-zoo" in card


def test_a_folder_where_a_file_goes_is_refused_before_anything_moves(model, tmp_path):
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    kept = snapshot(folder)
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").mkdir()  # the save writes a file of that name
    kept = snapshot(folder)
    changed = zoo.convert(tiny_native("mixtral", seed=3))
    with pytest.raises(SaveTargetError, match="a folder of that name"):
        changed.save_pretrained(folder)
    assert snapshot(folder) == kept  # not the new weights beside the old config


def test_a_written_file_gets_the_umasks_mode_not_a_private_one(tmp_path):
    """A GGUF or claims file another user or service reads (Ollama, a web server) is created as open() would create
    it (0666 less the umask), not with the staging file's private 0600."""
    import os
    import stat

    from zoo.io.atomic import atomic_file

    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "shared.txt") as staged:
            with open(staged, "w") as f:
                f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.txt").stat().st_mode) == 0o644
