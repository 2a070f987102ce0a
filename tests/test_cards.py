"""zoo.card: metadata, recipe, results, loading instructions and citations; the YAML parses back."""
import torch
from huggingface_hub import ModelCard

import zoo
from tiny import tiny_native

RESULT = {"perplexity": {"english": 101.5, "code": 40.25},
          "size": {"params": 15_000_000, "active_params": 6_000_000, "bytes": 31_000_000}}


def test_card_has_everything_and_round_trips_its_metadata(tmp_path):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "prune-reap", calibration=[torch.randint(3, 128, (2, 16))], num_experts=6)
    card = zoo.card(model, RESULT, repo_id="org/tiny-reap")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"moe", "moe-zoo", "custom_code", "qwen3_moe", "topk-softmax", "prune-reap"} <= set(data["tags"])
    metrics = {r["dataset"]["name"]: r["metrics"][0]["value"] for r in data["model-index"][0]["results"]}
    assert metrics == {"moe-zoo corpus (english)": 101.5, "moe-zoo corpus (code)": 40.25}
    text = card.text
    assert "`prune-reap` (compressor)" in text and '"num_experts": 6' in text and '"type": "batches"' in text
    assert 'from_pretrained("org/tiny-reap")' in text and "zoo.export(model, path)" in text
    assert "REAP the Experts" in text and "Qwen3 Technical Report" in text  # citations of what was used
    assert ModelCard(card.content).data.to_dict() == data  # the YAML parses back to the same data


def test_non_exportable_layout_says_why_and_save_writes_the_card(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert "has no native mixtral form" in zoo.card(model).text
    model.save_pretrained(tmp_path / "q")
    readme = (tmp_path / "q" / "README.md").read_text()
    assert readme.startswith("---\n") and "library_name: transformers" in readme and "Compressor: quantize" in readme
    assert "- moe-zoo" in readme and "- custom_code" in readme


def test_a_model_converted_from_a_hub_checkpoint_names_it_as_base_model(tmp_path):
    model = tiny_native("mixtral")
    model.config._name_or_path = "mistralai/Mixtral-8x7B-v0.1"  # as from_pretrained of that hub id sets it
    zoo.convert(model)
    assert zoo.card(model).data.base_model == "mistralai/Mixtral-8x7B-v0.1"
    model.save_pretrained(tmp_path / "m")
    assert "base_model: mistralai/Mixtral-8x7B-v0.1" in (tmp_path / "m" / "README.md").read_text()
    local = tiny_native("mixtral")
    local.save_pretrained(tmp_path / "native")
    assert zoo.card(zoo.load(str(tmp_path / "native"))).data.base_model is None  # a local folder is no hub id


def test_card_metadata_the_hub_links():
    """base_model with its relation for a converted Hub model; the license of the model it came from."""
    from zoo.publishing.cards import base_relation

    model = zoo.load("zoo-tiny-moe")
    assert zoo.card(model).data.license == "apache-2.0"  # the shipped model's, from the registry
    model.config.zoo_base_model = "mistralai/Mixtral-8x7B-v0.1"
    data = zoo.card(model).data
    assert (data.base_model, data.base_model_relation, data.license) == ("mistralai/Mixtral-8x7B-v0.1", "finetune",
                                                                         "apache-2.0")
    assert base_relation([{"kind": "compressor", "name": "quantize"}], None) == "quantized"
    assert base_relation([{"kind": "compressor", "name": "prune-reap"}], None) == "finetune"
    assert base_relation([], "org/base") == "adapter"
