"""A fine-tuned adapter folder is a model: ``zoo.load`` puts it on its base (the zoo adapter's own reload, or
PEFT's), it names its base portably, its card is the zoo's, and what needs a plain model says to merge first."""
import json
import os
import shutil

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import zoo
from zoo.io.adapter_folder import base_name, hub_id_of, is_adapter_folder, portable_base
from zoo.training.finetune import finetune
from zoo.io.loading import ZOO_VOCAB
from tiny import COMMON

IDS = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Mixtral with the zoo's vocabulary (so the zoo's tokenizer fits it) and a lora-experts adapter."""
    root = tmp_path_factory.mktemp("adapter-folder")
    torch.manual_seed(0)
    config = MixtralConfig(**{**COMMON, "vocab_size": ZOO_VOCAB, "max_position_embeddings": 256},
                           intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(root / "base")
    result = finetune(str(root / "base"), "lora-experts", {"r": 2}, domain="code", steps=2, batch_size=1,
                      seq_len=32, windows=1, out=str(root / "adapter"), progress=False)
    with torch.no_grad():
        logits = result.model(IDS).logits
    return root, logits


def test_the_folder_loads_as_its_base_with_the_adapter(trained):
    root, logits = trained
    adapter = root / "adapter"
    assert is_adapter_folder(adapter) and not is_adapter_folder(root / "base")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(root / "base")
    model = zoo.load(adapter)
    assert type(model).__name__ == "ZooPeftModel"  # lora-experts' own reload (its grouped forward)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, logits)
    assert zoo.moe.layout.moe_layers(model)  # the zoo's layer helpers see through the PEFT wrapper


def test_without_the_zoos_record_peft_loads_it(trained, tmp_path):
    root, logits = trained
    plain = tmp_path / "plain"
    shutil.copytree(root / "adapter", plain)
    (plain / "finetune.json").unlink()
    model = zoo.load(plain)
    assert type(model).__name__ != "ZooPeftModel" and hasattr(model, "merge_and_unload")
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, logits, atol=1e-5, rtol=1e-5)


def test_a_relative_base_is_read_from_the_folder(trained, tmp_path, monkeypatch):
    root, logits = trained
    shutil.copytree(root / "base", tmp_path / "base")
    shutil.copytree(root / "adapter", tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "../base"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path.parent)  # somewhere else
    assert base_name(tmp_path / "adapter") == str(tmp_path / "adapter" / "../base")
    with torch.no_grad():
        torch.testing.assert_close(zoo.load(tmp_path / "adapter")(IDS).logits, logits)


def test_a_missing_base_is_one_clear_error(trained, tmp_path):
    root, _ = trained
    shutil.copytree(root / "adapter", tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(OSError, match=r"is an adapter on .*gone, which cannot be loaded"):
        zoo.load(tmp_path / "adapter")


def test_the_card_is_the_zoos_and_names_no_local_base(trained):
    root, _ = trained
    card = (root / "adapter" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft") and "base_model" not in card.split("---")[1]
    assert "- moe-zoo" in card.split("---")[1] and "custom_code" not in card
    assert "lora-experts" in card and "merge_and_unload()" in card and "More Information Needed" not in card
    assert "1 windows of 32 tokens per domain" in card  # what the perplexity measured


def test_base_names_are_portable_and_only_hub_ids_reach_the_card(tmp_path):
    from zoo.components.registry import get_model

    assert portable_base("zoo-tiny-moe") == os.path.abspath(get_model("zoo-tiny-moe").local_path)  # PEFT opens it
    assert portable_base("mixtral.8x7b-v0.1") == "mistralai/Mixtral-8x7B-v0.1"
    assert portable_base("hf-hub:org/name") == "org/name"
    assert portable_base(str(tmp_path)) == str(tmp_path) and portable_base(None) is None
    assert hub_id_of("org/name") == "org/name"
    assert hub_id_of("mixtral.zoo-tiny-moe") is None  # shipped, not on the Hub
    assert hub_id_of(str(tmp_path)) is None and hub_id_of("./a/b") is None


def test_what_needs_a_plain_model_says_to_merge_first(trained):
    root, _ = trained
    model = zoo.load(root / "adapter")
    for action in (lambda: zoo.export(model, root / "never"), lambda: zoo.apply(model, "quantize", bits=8)):
        with pytest.raises(TypeError, match="merge_and_unload"):
            action()
    assert not (root / "never").exists()
    merged = model.merge_and_unload()
    zoo.export(merged, root / "native")
    assert json.loads((root / "native" / "config.json").read_text())["model_type"] == "mixtral"


PEFT_ONLY = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()  # as the zoo trained it
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
print("RESULT " + json.dumps({"logits": logits.tolist(), "zoo": "zoo" in sys.modules}))
"""


def test_plain_peft_opens_the_adapter_of_a_shipped_model_offline(tmp_path):
    """The adapter names the shipped model's folder as its base: AutoPeftModelForCausalLM, in a process that never
    imports zoo, loads base and adapter offline and computes the zoo's logits."""
    import subprocess
    import sys

    result = finetune("zoo-tiny-moe", "lora-experts", {"r": 2}, domain="code", steps=1, batch_size=1, seq_len=16,
                      windows=1, out=str(tmp_path / "adapter"), progress=False, bf16=False)
    ids = [[5, 9, 17, 33, 2, 64, 100, 7]]
    with torch.no_grad():
        want = result.model(torch.tensor(ids)).logits
    proc = subprocess.run([sys.executable, "-c", PEFT_ONLY, str(tmp_path / "adapter"), json.dumps(ids)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert not out["zoo"]
    torch.testing.assert_close(torch.tensor(out["logits"]), want.float(), rtol=0, atol=1e-4)
