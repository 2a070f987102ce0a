"""The zoo's own checkpoints: they load (with and without zoo), evaluate sanely, and the MoE beats its
dense control on held-out text of both domains."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.cli import cli
from zoo.evaluation.eval import evaluate
from zoo.components.registry import get_model

MOE, DENSE = get_model("zoo-tiny-moe"), get_model("zoo-tiny-dense")


WINDOWS = 24  # the held-out windows training validated on: 24 x 256 tokens per domain


@pytest.fixture(scope="module")
def results():  # in fp32: bf16 products are slow on processors without native bf16 (AVX2-only ones)
    tok = zoo.load_tokenizer("zoo-tiny-moe")
    return {name: evaluate(zoo.load(name, dtype=torch.float32).eval(), tok, max_windows=WINDOWS, measure_speed=False)
            for name in ("zoo-tiny-moe", "zoo-tiny-dense")}


def test_registry_entries_point_at_shipped_checkpoints():
    for entry in (MOE, DENSE):
        assert (Path(entry.local_path) / "model.safetensors").is_file()
        assert (Path(entry.local_path) / "tokenizer.json").is_file()
    assert (Path(MOE.local_path) / "README.md").read_text().count("library_name: moe-zoo") == 1


def test_native_checkpoints_load_without_zoo():
    code = ("import sys; from transformers import AutoModelForCausalLM as A;"
            f"m = A.from_pretrained({MOE.local_path!r}); d = A.from_pretrained({DENSE.local_path!r});"
            "assert 'zoo' not in sys.modules; print(type(m).__name__, type(d).__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["MixtralForCausalLM", "MistralForCausalLM"]


def test_sizes_and_evaluation_are_sane(results):
    moe, dense = results["zoo-tiny-moe"], results["zoo-tiny-dense"]
    assert 10e6 <= moe["size"]["params"] <= 30e6 and moe["size"]["bytes"] <= 4 * 30e6  # evaluated in fp32
    assert (Path(MOE.local_path) / "model.safetensors").stat().st_size <= 60e6  # shipped in bf16
    # the dense control has the MoE's active parameters
    assert abs(dense["size"]["params"] - moe["size"]["active_params"]) / dense["size"]["params"] < 0.02
    for r in (moe, dense):
        assert all(1 < p < 500 for p in r["perplexity"].values()), r["perplexity"]
    for domain, layers in moe["usage"].items():
        for layer in layers:
            assert sum(layer["counts"]) == WINDOWS * 256 * 2  # windows x tokens x top-2
            assert 0 < layer["entropy_bits"] <= layer["max_entropy_bits"]


def test_moe_beats_its_dense_control(results):
    for domain in ("english", "code"):
        assert results["zoo-tiny-moe"]["perplexity"][domain] < results["zoo-tiny-dense"]["perplexity"][domain]
    logs = {e.name: json.loads((Path(e.local_path) / "training.json").read_text()) for e in (MOE, DENSE)}
    moe_val, dense_val = logs[MOE.name]["val"][-1], logs[DENSE.name]["val"][-1]
    assert moe_val["step"] == dense_val["step"] and logs[MOE.name]["tokens"] == logs[DENSE.name]["tokens"]
    assert moe_val["english"] < dense_val["english"] and moe_val["code"] < dense_val["code"]


def test_main_job_end_to_end(tmp_path):
    res = CliRunner().invoke(cli, ["tour", "--out", str(tmp_path), "--windows", "2", "--no-speed"])
    assert res.exit_code == 0, res.output
    out = next(tmp_path.iterdir())
    assert {"model.safetensors", "README.md", "expert_usage.png", "eval.json"} <= {p.name for p in out.iterdir()}
    ev = json.loads((out / "eval.json").read_text())
    assert ev["after"]["size"]["bytes"] < 0.75 * ev["before"]["size"]["bytes"]  # 6 of 8 experts, then int8
    assert "prune-reap" in res.output and "quantize" in res.output and "before" in res.output
    loaded = zoo.load(str(out))
    assert [s["name"] for s in loaded.config.zoo_recipe] == ["prune-reap", "quantize"]


def test_upcycled_model_ships_sharded_with_experts_of_one_origin():
    """zoo-tiny-upcycled: zoo-tiny-dense upcycled and trained on as many tokens as zoo-tiny-moe; a native Mixtral
    in two shards; its experts, copies of one FFN trained apart, stay far more alike than zoo-tiny-moe's."""
    upcycled = get_model("zoo-tiny-upcycled")
    folder = Path(upcycled.local_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # each shard under 50 MiB
    log = json.loads((folder / "training.json").read_text())
    assert log["config"]["init"] == "zoo-tiny-dense" and log["config"]["init_recipe"].startswith("upcycle:")
    assert log["tokens"] == json.loads((Path(MOE.local_path) / "training.json").read_text())["tokens"]

    @torch.no_grad()
    def mean_cosine(model):
        values = []
        for layer in model.model.layers:
            w = layer.mlp.experts.gate_up_proj.flatten(1).double()
            w = w / w.norm(dim=1, keepdim=True)
            c = w @ w.T
            values.append(c[~torch.eye(len(c), dtype=torch.bool)].abs().mean())
        return float(torch.stack(values).mean())

    assert mean_cosine(zoo.load("zoo-tiny-upcycled")) > 0.5 > 0.1 > mean_cosine(zoo.load("zoo-tiny-moe"))
