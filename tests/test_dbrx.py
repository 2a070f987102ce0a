"""DBRX as a first-party family: its base model sits at ``.transformer`` (layers ``blocks``, MoE block ``ffn``), its
experts are three stacked [E*I, H] matrices (w1 gate, v1 up, w2 down), its router renormalises the kept weights by a
p-norm (``moe_normalize_expert_weights``). Converted losslessly, reloaded, exported back, changed by the zoo."""
import copy

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, DbrxConfig, DbrxForCausalLM

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel
from families.tiny_configs import TINY
from zoo.architectures.family import NotExportable
from zoo.moe.layout import block_prefix, moe_layers

IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def native_dbrx(p=1.0, seed=0):
    """The tiny DBRX of the families' list, experts 32 wide (the quantizer's group), routers with real spread."""
    values = copy.deepcopy(TINY["dbrx"])
    values["ffn_config"].update(ffn_hidden_size=32, moe_normalize_expert_weights=p)
    torch.manual_seed(seed)
    model = DbrxForCausalLM(DbrxConfig(**values)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.normal_(0, 0.5)
    return model


def logits(model, ids=IDS):
    return logits_of(model, ids)


def greedy(model):
    return greedy_of(model, IDS[:1], 6)


@pytest.fixture(scope="module")
def saved_native(tmp_path_factory):
    path = tmp_path_factory.mktemp("dbrx") / "native"
    native_dbrx().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("p", [1.0, 2.0, None], ids=["sum", "2-norm", "none"])
def test_convert_is_lossless_reloads_and_exports_back(p, tmp_path):
    native = native_dbrx(p)
    native_state = {k: v.clone() for k, v in native.state_dict().items()}
    want, want_tokens = logits(native), greedy(native)
    model = zoo.convert(native)
    assert type(model).__name__ == "ZooDbrxForCausalLM" and model.config.model_type == "zoo_dbrx"
    assert [i for i, _ in moe_layers(model)] == [0, 1] and block_prefix(model, 1) == "transformer.blocks.1.ffn."
    router = moe_layers(model)[0][1].router
    assert router.options == {"bias": False, "norm_topk_prob": p is not None, **({"norm_p": p} if p == 2.0 else {})}
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy(model), want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back), want) <= 1e-5
    base = AutoModel.from_pretrained(tmp_path / "zoo").eval()  # the base model alone: same blocks
    assert type(base).__name__ == "ZooDbrxModel" and len(moe_layers(base)) == 2

    zoo.export(back, tmp_path / "native")
    again = DbrxForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(again) is DbrxForCausalLM
    assert again.config.ffn_config.moe_normalize_expert_weights == p
    exported = again.state_dict()
    assert exported.keys() == native_state.keys()
    assert all(torch.equal(exported[k], v) for k, v in native_state.items())  # w1/v1/w2 bit for bit
    assert rel(logits(again), want) <= 1e-5


def test_balance_loss_is_dbrx_own_with_its_weight():
    native = native_dbrx()
    want = native(input_ids=IDS, labels=IDS, output_router_logits=True)
    model = zoo.convert(native)
    out = model(input_ids=IDS, labels=IDS, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (IDS.numel(), 4)
    assert torch.allclose(out.aux_loss, want.aux_loss, rtol=1e-5)
    assert torch.allclose(out.loss, want.loss, rtol=1e-5)  # moe_loss_weight, DBRX's key for the loss's weight


def test_p_norm_renormalisation_option_of_topk_softmax():
    from zoo.components.registry import registry

    cls = registry.get("router", "topk-softmax").obj
    router = cls(8, 4, 2, norm_p=3.0)
    x = torch.randn(5, 8)
    probs = torch.softmax(router.gate_logits(x), -1).topk(2, -1).values
    assert torch.allclose(router(x).weights, probs / torch.norm(probs, p=3.0, dim=-1, keepdim=True))
    assert "norm_p" not in cls(8, 4, 2, norm_p=1).options  # the sum, as before: layouts unchanged
    with pytest.raises(ValueError, match="needs norm_topk_prob=True"):
        cls(8, 4, 2, norm_topk_prob=False, norm_p=2.0)
    with pytest.raises(ValueError, match="finite number > 0"):
        cls(8, 4, 2, norm_p=0.0)


def test_components_apply_and_reload(tmp_path):
    model = zoo.convert(native_dbrx())
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert all(moe.num_experts == 3 for _, moe in moe_layers(model))
    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" for _, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back), out) <= 1e-5
    with pytest.raises(NotExportable):
        zoo.export(back, tmp_path / "native")


def test_zoo_load_converts_a_native_checkpoint(saved_native, tmp_path):
    want = logits(DbrxForCausalLM.from_pretrained(saved_native).eval())
    model = zoo.load(saved_native).eval()
    assert type(model).__name__ == "ZooDbrxForCausalLM" and len(moe_layers(model)) == 2
    assert rel(logits(model), want) <= 1e-5
    model.save_pretrained(tmp_path / "zoo")  # under the zoo's names, not the native w1/v1/w2
    assert rel(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()), want) <= 1e-5


def assert_same_tensors(a, b):
    from tiny import folder_tensors

    ta, tb = folder_tensors(a), folder_tensors(b)
    assert sorted(ta) == sorted(tb)
    assert all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def test_streamed_convert_apply_and_export_write_what_memory_writes(saved_native, tmp_path, one_thread):
    """Layer at a time from the shards (``transformer.blocks.<i>.``): the in-memory path's tensors, bit for bit."""
    from zoo.editing import stream

    zoo.load(saved_native).save_pretrained(tmp_path / "converted")
    stream.convert(saved_native, tmp_path / "converted-streamed")
    assert_same_tensors(tmp_path / "converted", tmp_path / "converted-streamed")

    pruned = zoo.apply(zoo.load(saved_native), "prune-frequency", calibration=CAL, num_experts=3)
    pruned.save_pretrained(tmp_path / "pruned")
    stream.apply(saved_native, [("prune-frequency", {"num_experts": 3})], tmp_path / "pruned-streamed", calibration=CAL)
    assert_same_tensors(tmp_path / "pruned", tmp_path / "pruned-streamed")

    zoo.export(pruned, tmp_path / "native")
    stream.export(tmp_path / "pruned-streamed", tmp_path / "native-streamed")
    assert_same_tensors(tmp_path / "native", tmp_path / "native-streamed")  # w1/v1/w2 under DBRX's own names
    assert DbrxForCausalLM.from_pretrained(tmp_path / "native-streamed").config.ffn_config.moe_num_experts == 3


def test_offloaded_experts_and_the_layer_by_layer_head_find_dbrx_own_paths(tmp_path):
    """Code that reads DBRX's checkpoint or runs its layers itself finds its base model at ``.transformer`` (layers
    ``blocks``, final norm ``norm_f``): the offloaded model computes what the loaded one does, and the head on the
    last block's output gives the model's logits."""
    from zoo.editing.head import final_norm, head_logits
    from zoo.moe.layout import decoder_layers

    model = zoo.convert(native_dbrx())
    want = logits(model)
    model.save_pretrained(tmp_path / "zoo")
    offloaded = zoo.offload(tmp_path / "zoo", cache_experts=2)
    assert rel(logits(offloaded), want) <= 1e-6
    assert final_norm(model) is model.transformer.norm_f
    seen = {}

    def keep(module, args, out):
        seen["h"] = out[0] if isinstance(out, tuple) else out

    hook = decoder_layers(model)[-1].register_forward_hook(keep)
    try:
        logits(model)
    finally:
        hook.remove()
    with torch.no_grad():
        assert rel(head_logits(model, seen["h"]).float(), want) <= 1e-6
