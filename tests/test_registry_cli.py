"""Model registry, zoo.load, and the moe-zoo command line."""
import json

import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.cli import cli
from zoo.components.options import parse_step
from zoo.moe.layout import moe_layers
from zoo.io.loading import HubUnavailable
from tiny import FAMILIES, padded_batch, tiny_native

IDS, MASK = padded_batch()


def test_list_models_patterns_and_metadata():
    mixtral = zoo.list_models("*mixtral*")
    assert mixtral and all(e.family == "mixtral" for e in mixtral)
    from zoo.architectures.families import GENERIC

    families = {e.family for e in zoo.list_models()}
    assert set(FAMILIES) | {"mistral", "zoo_mm"} <= families  # + dense control, multimodal
    assert families - set(FAMILIES) - {"mistral", "zoo_mm"} <= set(GENERIC)  # checkpoints of converted families only
    for e in zoo.list_models():
        assert e.name.startswith(e.family + ".") and e.license and e.paper
        assert ("/" in e.hub_id) if e.hub_id else e.local_path.endswith(e.name.split(".", 1)[1])
    assert zoo.list_models("nothing-like-this*") == []


def test_load_hub_id_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailable, match="offline"):
        zoo.load("mixtral.8x7b-v0.1")
    with pytest.raises(HubUnavailable, match="offline"):
        zoo.load("hf-hub:some-org/some-moe")


def test_load_unknown_registry_name_suggests():
    with pytest.raises(KeyError, match="did you mean"):
        zoo.load("mixtral.8x7b-v0.2")


def test_load_local_native_folder_converts(tmp_path):
    native = tiny_native("qwen2_moe")
    native.save_pretrained(tmp_path / "n")
    with torch.no_grad():
        ref = native(input_ids=IDS, attention_mask=MASK).logits
    model = zoo.load(str(tmp_path / "n")).eval()
    assert type(model).__name__ == "ZooQwen2MoeForCausalLM" and len(moe_layers(model)) == 2
    with torch.no_grad():
        assert (model(input_ids=IDS, attention_mask=MASK).logits - ref)[MASK.bool()].abs().max() < 1e-5
    assert type(zoo.load(str(tmp_path / "n"), convert=False)).__name__ == "Qwen2MoeForCausalLM"


def test_parse_step():
    assert parse_step("topk-softmax:top_k=1,norm_topk_prob=false") == (
        "topk-softmax", {"top_k": 1, "norm_topk_prob": False})
    assert parse_step("prune:domain=code") == ("prune", {"domain": "code"})
    assert parse_step('steer:disable={"1":[0,2],"3":[5]},force=[1, 2],note="a,b"') == (
        "steer", {"disable": {"1": [0, 2], "3": [5]}, "force": [1, 2], "note": "a,b"})


def test_cli_listing_commands():
    runner = CliRunner()
    res = runner.invoke(cli, ["models", "*olmoe*"])
    assert res.exit_code == 0 and "allenai/OLMoE-1B-7B-0924" in res.output
    res = runner.invoke(cli, ["components", "routers", "--json"])
    assert res.exit_code == 0 and {"topk-softmax", "sigmoid-bias"} <= {r["name"] for r in json.loads(res.output)}
    res = runner.invoke(cli, ["info", "sigmoid-bias"])
    info = json.loads(res.output)
    assert "DeepSeek-V3" in info["paper"] and "routed_scaling_factor" in info["options"]
    res = runner.invoke(cli, ["info", "sigmoid-bais"])
    assert res.exit_code != 0 and "did you mean 'sigmoid-bias'" in res.output
    res = runner.invoke(cli, ["plugins", "--all"])
    names = {p["name"] for p in json.loads(res.output)}
    assert {"zoo.architectures", "zoo_routers"} <= names


def test_cli_convert_and_apply(tmp_path):
    tiny_native("mixtral").save_pretrained(tmp_path / "native")
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", str(tmp_path / "native"), str(tmp_path / "zoo")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["apply", str(tmp_path / "zoo"), "topk-softmax:top_k=1", "--out", str(tmp_path / "k1")])
    assert res.exit_code == 0, res.output
    model = zoo.load(str(tmp_path / "k1"))
    assert [m.top_k for _, m in moe_layers(model)] == [1, 1]
    assert model.config.zoo_recipe[-1]["options"] == {"top_k": 1}
    res = runner.invoke(cli, ["apply", str(tmp_path / "zoo"), "topk-softmax:top_kk=1", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "did you mean 'top_k'" in res.output and not (tmp_path / "x").exists()


def test_info_shows_every_option_with_type_default_and_help():
    runner = CliRunner()
    reap = json.loads(runner.invoke(cli, ["info", "prune-reap"]).output)
    assert reap["options"]["num_experts"] == {"type": "int", "default": None, "required": True, "help": ""}
    top_p = json.loads(runner.invoke(cli, ["info", "top-p"]).output)["options"]
    assert "hidden_size" not in top_p and "num_experts" not in top_p  # zoo.apply gives a router the layer's
    assert top_p["p"] == {"type": "float", "default": 0.5, "required": False, "help": ""}
    assert top_p["max_k"]["type"] == "int | None" and top_p["top_k"]["required"] is False
    assert "the layer's own top_k" in top_p["top_k"]["help"]
    quantize = json.loads(runner.invoke(cli, ["info", "quantize"]).output)["options"]
    assert quantize["widths"]["default"] == [2, 3, 4, 8] and quantize["allocation"]["type"] == "str"


def test_describe_options_reads_signatures_along_the_mro_and_docstrings():
    from zoo.components.options import describe_options

    class Base:
        """A base.

        :param depth: how deep it goes
        """

        def __init__(self, depth: int = 2, scale=1.5, **options):
            pass

    class Child(Base):
        """- ``width`` (int): how wide it is, in channels
        mode: the mode (ignored when off)"""

        def __init__(self, width, mode: str | None = None, depth: int = 3, **options):
            super().__init__(depth=depth, **options)

    rows = {r.pop("name"): r for r in describe_options(Child, skip=("mode",))}
    assert list(rows) == ["width", "depth", "scale"]
    assert rows["width"] == {"type": "", "default": None, "required": True, "help": "how wide it is, in channels"}
    assert rows["depth"] == {"type": "int", "default": 3, "required": False, "help": "how deep it goes"}
    assert rows["scale"] == {"type": "float", "default": 1.5, "required": False, "help": ""}
    assert describe_options(Child)[1]["help"] == "the mode (ignored when off)"


def test_info_takes_a_model_short_name_and_suggests_models_too():
    runner = CliRunner()
    res = runner.invoke(cli, ["info", "zoo-tiny-moe"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["name"] == "mixtral.zoo-tiny-moe"
    assert json.loads(runner.invoke(cli, ["info", "mixtral.zoo-tiny-moe"]).output)["family"] == "mixtral"
    res = runner.invoke(cli, ["info", "zoo-tiny-mo"])
    assert res.exit_code != 0 and "did you mean 'zoo-tiny-moe'" in res.output


def test_components_columns_align_and_name_the_distribution():
    runner = CliRunner()
    rows = json.loads(runner.invoke(cli, ["components", "--json"]).output)
    res = runner.invoke(cli, ["components"])
    assert res.exit_code == 0, res.output
    header, *lines = res.output.splitlines()
    assert header.split() == ["KIND", "NAME", "DISTRIBUTION", "SUMMARY"] and len(lines) == len(rows)
    at = [header.index(word) for word in ("NAME", "DISTRIBUTION", "SUMMARY")]
    assert max(len(r["name"]) for r in rows) > 18  # longer than the old fixed column
    for line, r in zip(lines, rows):
        assert line.startswith(r["kind"] + " ") and line[at[0]:].startswith(r["name"] + " ")
        assert line[at[1]:].startswith(r["distribution"] + " ") and line[at[2]:] == r["summary"]


def test_info_asks_which_kind_when_two_kinds_share_a_name():
    runner = CliRunner()
    res = runner.invoke(cli, ["info", "channel-topk"])
    assert res.exit_code != 0 and "experts:channel-topk or compressor:channel-topk" in res.output
    assert "Traceback" not in res.output
    for kind in ("experts", "compressor"):
        res = runner.invoke(cli, ["info", f"{kind}:channel-topk"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["kind"] == kind
    res = runner.invoke(cli, ["info", "compresor:prune-reap"])
    assert res.exit_code != 0 and "did you mean 'compressor'" in res.output
