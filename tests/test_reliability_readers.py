"""One reader: every path that reads weights (zoo.load, streaming, offloading, GGUF from a folder, adapter folders)
refuses the same broken checkpoints with an error naming the file, never a number it cannot vouch for."""
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
import zoo.editing.stream
from tiny import tiny_native
from zoo.io.checkpoint import CheckpointError, Checkpoint
from zoo.io.gguf_export import export_gguf
from zoo.runtime.offloaded import NotOffloadable

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning")]
IDS = torch.tensor([[5, 9, 17, 33, 2, 64, 100, 7]])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A saved zoo Mixtral (2 layers, 4 experts), and the same saved in two shards."""
    model = zoo.convert(tiny_native("mixtral")).eval()
    one = tmp_path_factory.mktemp("one") / "m"
    model.save_pretrained(one)
    two = tmp_path_factory.mktemp("two") / "m"
    model.save_pretrained(two, max_shard_size="300KB")
    assert (two / "model.safetensors.index.json").is_file()
    return one, two


def copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in folder.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def readers(folder):
    """Every way the zoo reads a checkpoint folder's weights."""
    return {"load": lambda: zoo.load(folder),
            "stream": lambda: zoo.editing.stream.convert(folder, Path(folder).parent / "streamed"),
            "offload": lambda: zoo.offload(folder),
            "checkpoint": lambda: Checkpoint(folder)}


def all_refuse(folder, *needles):
    for name, read in readers(folder).items():
        with pytest.raises((CheckpointError, ValueError, OSError)) as excinfo:
            read()
        text = str(excinfo.value)
        assert "Traceback" not in text
        for needle in needles:
            assert needle in text, (name, text)
    assert not (Path(folder).parent / "streamed").exists()


def test_corrupt_header_names_the_file(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:12] = b"\xff\xfe{x"  # the JSON header broken
    (folder / "model.safetensors").write_bytes(bytes(data))
    all_refuse(folder, "model.safetensors")


def test_absurd_header_length_is_refused_without_reading_it(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)  # 1 TiB
    (folder / "model.safetensors").write_bytes(bytes(data))
    all_refuse(folder, "model.safetensors", "header claims")


def test_truncated_shard_is_refused(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    all_refuse(folder, "model.safetensors")


def test_index_naming_the_wrong_shard_says_which(clean, tmp_path):
    folder = copy(clean[1], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = "model.embed_tokens.weight"
    right = index["weight_map"][key]
    wrong = next(v for v in index["weight_map"].values() if v != right)
    index["weight_map"][key] = wrong
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    all_refuse(folder, key, wrong, f"it is in {right}")


def test_index_naming_a_file_outside_the_folder(clean, tmp_path):
    folder = copy(clean[1], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    all_refuse(folder, "not a file of the folder")


def test_integer_weights_never_load_as_floats(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    state[key] = (state[key] * 100).to(torch.int32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    all_refuse(folder, key, "torch.int32")


def test_extra_layers_are_not_dropped(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    for key in [k for k in state if k.startswith("model.layers.1.")]:
        state[key.replace("layers.1.", "layers.2.")] = state[key].clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    all_refuse(folder, "layer")  # (transformers names the extra tensors; the stream says "layer 2")
    with pytest.raises(CheckpointError, match="tensors of layer 2"):
        zoo.editing.stream.convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_tensor_never_loads_as_random_numbers(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.o_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    all_refuse(folder, "o_proj")


def test_a_folder_rewritten_in_this_process_is_read_anew(tmp_path):
    """The shard-header cache follows the file's contents: saving another model into the folder, then reading it
    again in the same process, reads the new header (not the old one, which would say 'truncated')."""
    folder = tmp_path / "m"
    zoo.convert(tiny_native("mixtral", seed=0)).save_pretrained(folder)
    zoo.editing.stream.convert(folder, tmp_path / "a")
    from transformers import MixtralConfig, MixtralForCausalLM
    from tiny import COMMON
    bigger = MixtralForCausalLM(MixtralConfig(**{**COMMON, "vocab_size": 256}, intermediate_size=96,
                                              num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2))
    (folder / "model.safetensors").unlink()
    (folder / "config.json").unlink()
    zoo.convert(bigger).save_pretrained(folder)
    zoo.editing.stream.convert(folder, tmp_path / "b")
    assert zoo.load(tmp_path / "b").model.embed_tokens.weight.shape[0] == 256


@pytest.mark.parametrize("options", [{}, {"reader": "in-place", "cache_experts": 2}])
def test_offload_refuses_nan_experts_like_load(clean, tmp_path, options):
    folder = copy(clean[0], tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    key = next(k for k in state if k.endswith("experts.gate_up_proj"))
    state[key][1, 0, 0] = float("nan")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN"):
        zoo.load(folder)
    with pytest.raises(NotOffloadable, match="NaN or inf in the experts of layer 0"):
        zoo.offload(folder, reader="in-place")  # (in place without a budget: every expert checked as it opens)
    off = zoo.offload(folder, **options)  # (opening reads no expert)
    with pytest.raises(NotOffloadable, match="NaN or inf in expert 1 of layer 0"):
        with torch.no_grad():
            for _ in range(8):  # until the router picks expert 1 of layer 0
                off(input_ids=torch.randint(3, 128, (4, 16)))


@pytest.mark.parametrize("reader", ["pread", "in-place"])
@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace"])
def test_offload_refuses_a_shard_changed_after_opening(clean, tmp_path, change, reader):
    folder = copy(clean[0], tmp_path / "m")
    off = zoo.offload(folder, cache_experts=0, reader=reader)  # (in place: every expert's pages given back)
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    if change == "truncate":
        os.truncate(shard, len(data) - 4096)
    elif change == "replace":  # another file of the same bytes, size and modification time: only the inode differs
        shutil.copy2(shard, folder / "other")
        os.replace(folder / "other", shard)
    else:  # same size, zeros over the last experts' bytes, a later modification time
        with open(shard, "r+b") as f:
            f.seek(len(data) - 4096)
            f.write(bytes(4096))
        st = os.stat(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(NotOffloadable, match="changed since the model was opened"):
        with torch.no_grad():
            off(input_ids=IDS)


def test_gguf_from_a_folder_reads_through_the_same_checks(tmp_path):
    folder = tmp_path / "native"
    zoo.export(zoo.convert(tiny_native("mixtral")), folder)
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"][3] = float("inf")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN or inf in .*model.norm.weight"):  # (a checkpoint's, or a load's, error)
        export_gguf(folder, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_adapter_on_a_base_of_other_shapes_names_the_base(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM
    from tiny import COMMON

    small = zoo.convert(tiny_native("mixtral"))
    small.save_pretrained(tmp_path / "base")
    peft = get_peft_model(small, LoraConfig(r=2, target_modules=["q_proj"]))
    peft.save_pretrained(tmp_path / "ad")
    other = MixtralForCausalLM(MixtralConfig(**{**COMMON, "hidden_size": 32, "num_attention_heads": 2},
                                             intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                             num_experts_per_tok=2))
    (tmp_path / "base" / "model.safetensors").unlink()
    (tmp_path / "base" / "config.json").unlink()
    zoo.convert(other).save_pretrained(tmp_path / "base")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not fit its base .*base.*other shapes"):
        zoo.load(tmp_path / "ad")


def test_pickled_weights_are_never_unpickled(clean, tmp_path):
    folder = copy(clean[0], tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        zoo.load(folder)
    with pytest.raises(ValueError, match="safetensors only"):
        zoo.load(clean[0], use_safetensors=False)


def test_what_the_family_drops_on_purpose_is_not_an_extra_layer(tmp_path, monkeypatch):
    """DeepSeek-V3 checkpoints hold a multi-token-prediction layer past the config's layers, which transformers drops
    (``_keys_to_ignore_on_load_unexpected``): streaming and zoo.load drop it too, while any other extra layer is
    refused."""
    from transformers import DeepseekV3ForCausalLM

    model = tiny_native("deepseek_v3")
    model.save_pretrained(tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state["model.layers.3.mtp_head.weight"] = torch.ones(4, 4)  # the tiny model has layers 0-2
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 3"):
        Checkpoint(tmp_path / "m")
    monkeypatch.setattr(DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.3\..*"])
    zoo.editing.stream.convert(tmp_path / "m", tmp_path / "out")
    with torch.no_grad():
        ids = torch.tensor([[5, 9, 17, 33]])
        torch.testing.assert_close(zoo.load(tmp_path / "out")(input_ids=ids).logits,
                                   zoo.convert(model)(input_ids=ids).logits, rtol=0, atol=1e-5)
    zoo.load(tmp_path / "m")
