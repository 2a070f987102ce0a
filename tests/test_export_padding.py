"""A model whose layers differ in expert count exports to its family's native format by padding each layer with
experts the router never picks, where the family's router can express that exactly (GPT-OSS: a router bias); a
family whose router cannot (no bias: a padded expert's logit would be 0) is refused with that reason."""
import json
import os
import subprocess
import sys

import pytest
import torch

import zoo
import zoo.editing.stream
from tiny import tiny_native
from zoo.architectures.family import NotExportable
from zoo.io.convert import export_padding
from zoo.moe.layout import moe_layers, put_block, decoder_layers, sync_layout
from zoo.moe.surgery import keep_experts

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning")]
IDS = [[5, 9, 17, 33, 2, 64, 100, 7, 3, 11]]

NATIVE = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    out = model(torch.tensor(json.loads(sys.argv[2]))).logits
print("RESULT " + json.dumps({"logits": out.tolist(), "cls": type(model).__name__, "zoo": "zoo" in sys.modules}))
"""


def pruned(family: str, keep: dict):
    model = zoo.convert(tiny_native(family)).eval()
    for (i, moe), layer in zip(moe_layers(model), decoder_layers(model)):
        if i in keep:
            put_block(layer, keep_experts(moe, keep[i]))
    sync_layout(model)
    return model


def test_gpt_oss_layers_of_different_counts_export_exactly(tmp_path):
    model = pruned("gpt_oss", {0: [0, 2, 3]})  # layer 0: 3 experts, layer 1: 4
    assert [m.num_experts for _, m in moe_layers(model)] == [3, 4]
    padding = export_padding(model)
    assert padding["num_experts"] == 4 and padding["layers"] == {0: 1} and padding["bytes"] > 0
    expert = model.model.layers[0].mlp.experts
    assert padding["bytes"] == expert.nbytes() // 3
    with torch.no_grad():
        want = model(input_ids=torch.tensor(IDS)).logits
    zoo.export(model, tmp_path / "native")
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["num_local_experts"] == 4
    proc = subprocess.run([sys.executable, "-c", NATIVE, str(tmp_path / "native"), json.dumps(IDS)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert out["cls"] == "GptOssForCausalLM" and not out["zoo"]
    torch.testing.assert_close(torch.tensor(out["logits"]), want, rtol=0, atol=1e-5)
    assert "padded to 4 experts" in zoo.card(model).text  # the card states the padding and its cost
    # streamed, the same checkpoint
    model.save_pretrained(tmp_path / "zoo")
    zoo.editing.stream.export(tmp_path / "zoo", tmp_path / "streamed")
    a = zoo.load(tmp_path / "native", convert=False).state_dict()
    b = zoo.load(tmp_path / "streamed", convert=False).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_router_without_bias_is_refused_with_the_reason(tmp_path):
    model = pruned("mixtral", {0: [0, 1, 3]})
    assert export_padding(model) is None
    with pytest.raises(NotExportable, match="no bias with which a padded expert could never be chosen"):
        zoo.export(model, tmp_path / "native")
    assert not (tmp_path / "native").exists()
    assert "no bias with which a padded expert" in zoo.card(model).text


def test_different_k_is_refused(tmp_path):
    model = pruned("gpt_oss", {})
    moe_layers(model)[0][1].router.top_k = 1  # layer 0 routes to 1 expert, layer 1 to 2
    sync_layout(model)
    with pytest.raises(NotExportable, match="holds one k for all layers"):
        zoo.export(model, tmp_path / "native")
