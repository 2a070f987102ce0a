"""Compressors on a bf16 model, in sequence, and the native export of a merged uniform layout."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from tiny import tiny_native

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]
EVERY = [("prune-frequency", {"num_experts": 2}), ("prune-reap", {"num_experts": 2}), ("hc-smoe", {"num_experts": 2}),
         ("sub-moe", {"num_experts": 2}), ("moe-svd", {"ratio": 0.5}), ("quantize", {"bits": 8, "group_size": 32}),
         ("channel-topk", {"budget": 0.5})]


@pytest.mark.parametrize("name,options", EVERY, ids=[n for n, _ in EVERY])
def test_every_compressor_keeps_a_bf16_model_bf16(name, options):
    model = zoo.convert(tiny_native("mixtral")).to(torch.bfloat16)
    zoo.apply(model, name, calibration=CAL, **options)
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=CAL[0]).logits.float()).all()


def test_hc_smoe_then_moe_svd_compose_and_roundtrip(tmp_path):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=4)
    zoo.apply(model, "moe-svd", calibration=CAL, ratio=0.5)
    assert [s["name"] for s in model.config.zoo_recipe] == ["hc-smoe", "moe-svd"]
    with torch.no_grad():
        logits = model(input_ids=CAL[0]).logits
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert [(m.num_experts, m.experts.name) for _, m in moe_layers(loaded)] == [(4, "factored")] * 2
    with torch.no_grad():
        assert (loaded(input_ids=CAL[0]).logits - logits).abs().max() < 1e-6


def test_merged_uniform_layout_exports_natively(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=3, router="cut")  # one router row per expert
    with torch.no_grad():
        logits = model(input_ids=CAL[0]).logits
    zoo.export(model, tmp_path / "native")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(native).__name__ == "MixtralForCausalLM" and native.config.num_local_experts == 3
    with torch.no_grad():
        assert (native(input_ids=CAL[0]).logits - logits).abs().max() < 1e-5
