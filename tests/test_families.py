"""Lossless conversion, AutoModel round-trip and native export for every supported family."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.architectures.family import NotExportable
from zoo.io.convert import family_of
from zoo.moe.layout import build_block, moe_layers
from zoo.moe import SparseMoE
from tiny import FAMILIES, padded_batch, tiny_native

IDS, MASK = padded_batch()
REAL = MASK.bool()  # compare logits at real (non-padding) positions


def logits(model, ids=IDS, mask=MASK):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_is_lossless(family):
    model = tiny_native(family)
    native_cls = type(model)
    ref = logits(model)
    ref_tokens = model.generate(IDS[:1], attention_mask=MASK[:1], max_new_tokens=8, do_sample=False)
    zoo.convert(model)
    assert type(model).__name__ == "Zoo" + native_cls.__name__
    assert model.config.model_type == f"zoo_{family}"
    assert moe_layers(model), "no MoE block was converted"
    assert not any(isinstance(m, family_of(model).block_class) for m in model.modules()), "native block left"
    out = logits(model)
    assert (out - ref)[REAL].abs().max().item() < 1e-5
    tokens = model.generate(IDS[:1], attention_mask=MASK[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_and_aux_loss_reach_the_output(family):
    model = zoo.convert(tiny_native(family))
    out = model(input_ids=IDS, attention_mask=MASK, labels=IDS, output_router_logits=True)
    n_moe = len(moe_layers(model))
    assert len(out.router_logits) == n_moe
    assert out.router_logits[0].shape == (IDS.numel(), moe_layers(model)[0][1].num_experts)
    if family == "deepseek_v3":
        assert out.aux_loss is None  # balanced by the selection bias, not a loss
    else:
        assert out.aux_loss is not None and out.aux_loss.item() > 0
        plain = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
        coef = model.config.router_aux_loss_coef
        assert torch.allclose(out.loss, plain + coef * out.aux_loss, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_automodel_roundtrip(family, tmp_path):
    model = zoo.convert(tiny_native(family))
    ref = logits(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(loaded) is type(model)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    # bit-identical weights; logits may differ in the last ulp from memory alignment of loaded tensors
    assert (logits(loaded) - ref).abs().max().item() < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loaded_native_checkpoint_resaves_under_zoo_names(family, tmp_path):
    """transformers writes a model back under the key names it was loaded from (Mixtral: per-expert
    w1/w2/w3); a zoo model converted from such a load must save under its own names and reload."""
    tiny_native(family).save_pretrained(tmp_path / "native")
    model = zoo.load(tmp_path / "native").eval()
    ref = logits(model)
    model.save_pretrained(tmp_path / "zoo")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert (logits(loaded) - ref).abs().max().item() < 1e-6


PLAIN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
results = {}
for family, folder, io_file in json.loads(sys.argv[1]):
    try:
        io = torch.load(io_file, weights_only=True)
        m = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert "zoo" not in sys.modules, "zoo was imported"
        assert not type(m).__name__.startswith("Zoo"), type(m).__name__
        with torch.no_grad():
            out = m(input_ids=io["ids"], attention_mask=io["mask"]).logits
        results[family] = (out - io["ref"])[io["mask"].bool()].abs().max().item()
    except Exception as exc:
        results[family] = f"{type(exc).__name__}: {exc}"
print("RESULTS", json.dumps(results))
"""


@pytest.fixture(scope="module")
def plain_loads(tmp_path_factory):
    """{family: max logit difference, or the error} of every family's export loaded by plain transformers in one
    fresh process that never imports zoo (one process for all: each pays ~8 s of imports)."""
    jobs = []
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model = zoo.convert(tiny_native(family))
        zoo.export(model, folder / "native")
        torch.save({"ids": IDS, "mask": MASK, "ref": logits(model)}, folder / "io.pt")
        jobs.append((family, str(folder / "native"), str(folder / "io.pt")))
    run = subprocess.run([sys.executable, "-c", PLAIN_LOAD, json.dumps(jobs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_plain_transformers(family, plain_loads):
    diff = plain_loads[family]
    assert isinstance(diff, float) and diff < 1e-5, diff


def _nonuniform_mixtral():
    """Layer 0: 3 experts, top-1; layer 1: 8 experts, top-2 -- no native Mixtral config can say this."""
    model = zoo.convert(tiny_native("mixtral"))
    torch.manual_seed(1)
    for i, (n, k) in enumerate([(3, 1), (8, 2)]):
        entry = model.model.layers[i].mlp.layout()
        entry.update(num_experts=n, num_experts_per_tok=k)
        entry["experts_options"]["num_experts"] = n
        block = build_block(entry)
        with torch.no_grad():
            block.router.weight.normal_(0, 0.5)
        model.model.layers[i].mlp = block
    return model


def test_nonuniform_layout_roundtrip(tmp_path):
    model = _nonuniform_mixtral()
    ref = logits(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    layers = [(m.num_experts, m.top_k) for _, m in moe_layers(loaded)]
    assert layers == [(3, 1), (8, 2)]
    assert (logits(loaded) - ref).abs().max().item() < 1e-6
    out = loaded(input_ids=IDS, attention_mask=MASK, labels=IDS, output_router_logits=True)
    assert [t.shape[-1] for t in out.router_logits] == [3, 8] and out.aux_loss is not None


def test_export_refuses_nonuniform_layout_with_reason(tmp_path):
    model = _nonuniform_mixtral()
    with pytest.raises(NotExportable, match="layer 1 routes each token to 2 experts but layer 0 to 1"):
        zoo.export(model, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_export_refuses_non_native_router(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "topk-softmax", norm_topk_prob=False)
    with pytest.raises(NotExportable, match="router_options"):
        zoo.export(model, tmp_path / "native")


def test_convert_twice_is_a_no_op():
    model = zoo.convert(tiny_native("olmoe"))
    blocks = [m for _, m in moe_layers(model)]
    assert zoo.convert(model) is model
    assert [m for _, m in moe_layers(model)] == blocks and all(isinstance(b, SparseMoE) for b in blocks)


def test_family_of_prefers_the_most_specific_family():
    """A plugin family whose model class subclasses Mixtral's claims its own models, whatever its name."""
    from transformers import MixtralForCausalLM

    from tiny import tiny_config
    from zoo.architectures.mixtral import Mixtral
    from zoo.io.convert import family_of
    from zoo.components.registry import Registered, registry

    class DerivedMixtral(MixtralForCausalLM):
        pass

    class Derived(Mixtral):
        name, model_class = "zz_derived_mixtral", DerivedMixtral  # sorts after "mixtral", which matches it too

    derived = Derived()
    registry.add_all([Registered("architecture", derived.name, derived, "tests", "tests")])
    try:
        assert family_of(DerivedMixtral(tiny_config("mixtral"))) is derived
        assert family_of(MixtralForCausalLM(tiny_config("mixtral"))).name == "mixtral"
    finally:
        registry.entries["architecture"].pop(derived.name)
