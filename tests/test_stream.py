"""Layer-at-a-time from the shards (zoo.editing.stream) against the in-memory path: the same tensors, bit for bit."""
import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import zoo
from zoo.editing import stream
from zoo.io.checkpoint import Checkpoint, CheckpointError
from tiny import FAMILIES, folder_tensors, tiny_native

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]


tensors = folder_tensors


def assert_same_tensors(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Native checkpoints as transformers writes them (per-expert key names), one per family."""
    root = tmp_path_factory.mktemp("native")
    paths = {}
    for family in FAMILIES:
        tiny_native(family).save_pretrained(root / family)
        paths[family] = str(root / family)
    return paths


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_convert_writes_what_convert_and_save_write(family, native, tmp_path, one_thread):
    zoo.load(native[family]).save_pretrained(tmp_path / "memory")
    stream.convert(native[family], tmp_path / "stream")
    assert_same_tensors(tmp_path / "memory", tmp_path / "stream")
    cfg = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert cfg["model_type"] == f"zoo_{family}" and cfg["zoo_layout"]
    ids = CAL[0]
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(native[family])(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-5


STEPS = [
    ("prune-frequency", {"num_experts": 2}),
    ("prune-reap", {"num_experts": 2}),
    ("hc-smoe", {"num_experts": 2}),
    ("hc-smoe", {"num_experts": 2, "router": "cut", "router_rows": "average"}),
    ("sub-moe", {"num_experts": 2, "rank_ratio": 0.5}),
    ("hodge-cover", {"num_experts": 2}),
    ("hodge-cover", {"num_experts": 3, "reduce": "prune", "sparsity": 0.5}),
    ("moe-svd", {"ratio": 0.5}),
    ("quantize", {"bits": 4, "group_size": 32}),
    ("quantize", {"bits": 3, "allocation": "pmq", "widths": [2, 4], "group_size": 32}),
    ("quantize", {"bits": 3, "allocation": "alphaq", "widths": [2, 4], "group_size": 32}),
    ("quantize", {"bits": 3, "allocation": "random", "widths": [2, 4], "group_size": 32}),
    ("quantize", {"bits": 8, "targets": "all"}),
    ("quantize", {"bits": 4, "group_size": 32, "targets": "all"}),
    ("channel-topk", {"budget": 0.5}),
    ("topk-softmax", {"top_k": 1}),
]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("name,options", STEPS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(STEPS)])
def test_every_component_gives_identical_tensors_streamed(family, name, options, native, tmp_path, one_thread):
    model = zoo.apply(zoo.load(native[family]), name, calibration=CAL, **options)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(native[family], [(name, options)], tmp_path / "stream", calibration=CAL)
    assert_same_tensors(tmp_path / "memory", tmp_path / "stream")
    recipe = json.loads((tmp_path / "stream" / "config.json").read_text())["zoo_recipe"]
    assert recipe[-1]["name"] == name and recipe[-1]["options"] == options
    assert recipe[-1].get("results") == model.config.zoo_recipe[-1].get("results")


def test_a_two_step_recipe_streams_in_one_go_with_identical_tensors(native, tmp_path, one_thread):
    """prune-reap then PMQ quantization (which needs its own statistics pass over the pruned layers)."""
    steps = [("prune-reap", {"num_experts": 3}),
             ("quantize", {"bits": 3, "allocation": "pmq", "widths": [2, 4], "group_size": 32})]
    model = zoo.load(native["qwen3_moe"])
    for name, options in steps:
        model = zoo.apply(model, name, calibration=CAL, **options)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(native["qwen3_moe"], steps, tmp_path / "stream", calibration=CAL)
    assert_same_tensors(tmp_path / "memory", tmp_path / "stream")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=CAL[1]).logits, model(input_ids=CAL[1]).logits)
    assert [s["name"] for s in loaded.config.zoo_recipe] == ["prune-reap", "quantize"]


def test_a_zoo_checkpoint_streams_too_and_shards_are_written_with_an_index(native, tmp_path, one_thread):
    zoo.apply(zoo.load(native["mixtral"]), "prune-reap", calibration=CAL, num_experts=3).save_pretrained(
        tmp_path / "pruned", max_shard_size="60KB")
    assert (tmp_path / "pruned" / "model.safetensors.index.json").exists()
    memory = zoo.apply(zoo.load(tmp_path / "pruned"), "quantize", bits=8, group_size=32)
    memory.save_pretrained(tmp_path / "memory")
    stream.apply(tmp_path / "pruned", [("quantize", {"bits": 8, "group_size": 32})], tmp_path / "stream")
    index = json.loads((tmp_path / "stream" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # a shard a layer, and one for the embeddings and head
    assert_same_tensors(tmp_path / "memory", tmp_path / "stream")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_streamed_export_writes_the_native_checkpoint_export_writes(family, native, tmp_path, one_thread):
    pruned = zoo.apply(zoo.load(native[family]), "prune-frequency", calibration=CAL, num_experts=2)
    pruned.save_pretrained(tmp_path / "zoo")
    zoo.export(pruned, tmp_path / "memory")
    stream.export(tmp_path / "zoo", tmp_path / "stream")
    assert_same_tensors(tmp_path / "memory", tmp_path / "stream")  # the native (per-expert) key names too
    assert json.loads((tmp_path / "stream" / "config.json").read_text())["model_type"] == family


def test_streamed_eval_matches_in_memory_eval(one_thread):
    from zoo.evaluation.eval import evaluate

    memory = evaluate(zoo.load("zoo-tiny-moe").eval(), max_windows=2, measure_speed=False)
    streamed = stream.evaluate("zoo-tiny-moe", max_windows=2)
    for split in ("perplexity", "perplexity_ood"):  # held-out and out-of-domain text
        assert list(streamed[split]) == list(memory[split]) == ["english", "code"]
        for d, v in memory[split].items():
            assert abs(streamed[split][d] - v) <= 1e-4 * v
    assert memory["perplexity_ood"] != memory["perplexity"]
    assert streamed["usage"] == memory["usage"] and streamed["size"] == memory["size"]
    assert "perplexity_ood" not in stream.evaluate("zoo-tiny-moe", max_windows=1, ood=False)


def test_only_one_layer_is_ever_materialised(native, tmp_path, monkeypatch, one_thread):
    real = Checkpoint.load_layer
    seen = []

    def load_layer(self, i):
        seen.append([j for j, layer in enumerate(self.layers)
                     if any(not p.is_meta for p in layer.parameters())])
        return real(self, i)

    monkeypatch.setattr(Checkpoint, "load_layer", load_layer)
    stream.apply(native["qwen2_moe"], [("prune-reap", {"num_experts": 3})], tmp_path / "out", calibration=CAL)
    assert seen == [[], [], []]  # when a layer is read, every other layer is back on the meta device


def test_bad_options_and_broken_checkpoints_write_nothing(native, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'num_experts'"):
        stream.apply(native["mixtral"], [("prune-reap", {"num_expert": 2})], tmp_path / "a", calibration=CAL)
    with pytest.raises(ValueError, match="has only 4 experts"):
        stream.apply(native["mixtral"], [("prune-reap", {"num_experts": 9})], tmp_path / "a", calibration=CAL)
    with pytest.raises(ValueError, match="in memory"):
        stream.apply(native["mixtral"], [("lora-experts", {})], tmp_path / "a")
    assert not (tmp_path / "a").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(native["mixtral"]):
        data = open(os.path.join(native["mixtral"], f), "rb").read()
        (broken / f).write_bytes(data)
    sd = load_file(broken / "model.safetensors")
    del sd["model.layers.1.self_attn.q_proj.weight"]
    from safetensors.torch import save_file

    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks tensors of layer 1"):
        stream.convert(broken, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_the_command_line_streams_by_itself_when_the_budget_is_small(tmp_path, one_thread):
    from zoo.cli import cli

    runner = CliRunner()
    small = runner.invoke(cli, ["apply", "zoo-tiny-moe", "prune-reap:num_experts=6", "--out", str(tmp_path / "s"),
                                "--max-memory", "10KB", "--calibration", "code:512"])
    assert small.exit_code == 0, small.output
    assert "layer by layer" in small.output
    large = runner.invoke(cli, ["apply", "zoo-tiny-moe", "prune-reap:num_experts=6", "--out", str(tmp_path / "m"),
                                "--max-memory", "10GB", "--calibration", "code:512"])
    assert large.exit_code == 0 and "layer by layer" not in large.output
    assert_same_tensors(tmp_path / "s", tmp_path / "m")
    bad = runner.invoke(cli, ["convert", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--stream"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and "nowhere" in bad.output
    assert runner.invoke(cli, ["export", str(tmp_path / "s"), str(tmp_path / "n"), "--stream"]).exit_code == 0
    assert (tmp_path / "n" / "config.json").exists()
