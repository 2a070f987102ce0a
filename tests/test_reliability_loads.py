"""Strict loads: a tensor the checkpoint lacks is initialised as native transformers would, or the load fails
naming it; never uninitialised memory. NaN/inf weights are refused with their names.

Missing tensors are poisoned with NaN (and integer ones with a pattern) the moment transformers allocates
them, so anything left uninitialised shows instead of happening to be zero."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import PreTrainedModel

import zoo
from zoo.io.finite import NonFiniteWeightsError
from zoo.moe.factored import FactoredExperts
from zoo.moe.init import MissingWeightsError
from zoo.moe.quantized import QuantizedExperts
from tiny import tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")
CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    original = PreTrainedModel._move_missing_keys_from_meta_to_device

    def poisoned(self, missing_keys, *args, **kwargs):
        original(self, missing_keys, *args, **kwargs)
        keys = set(missing_keys) | {k for k, _ in self.named_non_persistent_buffers()}
        with torch.no_grad():
            for key in keys:
                t = self.get_parameter_or_buffer(key)
                t.fill_(float("nan") if t.is_floating_point() else 85)

    monkeypatch.setattr(PreTrainedModel, "_move_missing_keys_from_meta_to_device", poisoned)


def build(case):
    family, step, options = case
    model = zoo.convert(tiny_native(family))
    if step:
        model = zoo.apply(model, step, calibration=CAL, **options)
    return model


CASES = {
    "mixtral": ("mixtral", None, {}),
    "qwen2-shared-experts": ("qwen2_moe", None, {}),
    "deepseek-sigmoid-bias": ("deepseek_v3", None, {}),
    "gpt-oss-biases": ("gpt_oss", None, {}),
    "quantized-int4": ("mixtral", "quantize", {"bits": 4, "group_size": 32}),
    "quantized-int8": ("mixtral", "quantize", {"bits": 8, "group_size": 32}),
    "moe-svd": ("mixtral", "moe-svd", {"ratio": 0.5}),
    "mixture-of-loras": ("mixtral", "mixture-of-loras", {"num_loras": 2, "r": 2}),
    "replora": ("mixtral", "replora", {"r": 2, "hidden": 4}),
    "expert-choice": ("mixtral", "expert-choice", {}),
}


def refused(model, key) -> bool:
    """Tensors with no meaningful initialisation (packed weights, low-rank factors): a load must name them."""
    owner = model.get_submodule(key.rsplit(".", 1)[0])
    return isinstance(owner, (QuantizedExperts, FactoredExperts)) and not key.endswith("bias")


def drop(folder, key):
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def zoo_keys(model) -> list[str]:
    """The checkpoint keys of zoo modules (routers, experts, adapters), and one native key for control."""
    keys = [k for k in model.state_dict() if ".mlp." in k or "lora" in k or "input_" in k or "mlp_" in k]
    return list(dict.fromkeys(keys + ["model.layers.0.input_layernorm.weight"]))


@pytest.mark.parametrize("case", list(CASES))
def test_every_missing_tensor_is_initialised_or_named(case, tmp_path):
    model = build(CASES[case])
    model.save_pretrained(tmp_path / "full")
    full = load_file(tmp_path / "full" / "model.safetensors")
    keys = [k for k in zoo_keys(model) if k in full]
    assert keys
    for key in keys:
        folder = tmp_path / key
        folder.mkdir()
        for f in ("config.json", "model.safetensors"):
            (folder / f).write_bytes((tmp_path / "full" / f).read_bytes())
        drop(folder, key)
        if refused(model, key):
            with pytest.raises(MissingWeightsError, match=key.split(".")[-1]):
                AutoModelForCausalLM.from_pretrained(folder)
            continue
        loaded = AutoModelForCausalLM.from_pretrained(folder)  # the finite check would catch the poison
        t = loaded.state_dict()[key]
        assert torch.isfinite(t.float()).all(), key
        if "norm" in key:
            assert (t == 1).all(), f"{key}: a missing norm weight starts at one"
        elif key.endswith(("bias", "lora_B")):
            assert not t.any(), f"{key}: a missing bias / LoRA B starts at zero"
        elif t.is_floating_point() and t.numel() > 8:
            assert 0 < t.float().std() < 1.5, f"{key}: not initialised like native"
        out = loaded(CAL[0][:1]).logits
        assert torch.isfinite(out).all(), key


def test_quantized_index_tables_are_rebuilt_on_load(tmp_path):
    model = build(CASES["quantized-int4"])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (_, a), (_, b) in zip(zoo.moe.layout.moe_layers(model), zoo.moe.layout.moe_layers(loaded)):
        assert torch.equal(a.experts.width_of, b.experts.width_of)
        assert torch.equal(a.experts.slot_of, b.experts.slot_of)


def test_changed_bits_in_config_fail_with_the_tensor_name(tmp_path):
    model = build(CASES["quantized-int4"])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for entry in config["zoo_layout"]:
        if entry and entry["experts"] == "quantized":
            entry["experts_options"]["bits"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MissingWeightsError, match="int8"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_nan_in_a_checkpoint_is_refused_with_its_name(tmp_path):
    model = build(CASES["mixtral"])
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.mlp.experts.down_proj"
    tensors[key][0, 0, 0] = float("inf")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError, match=key.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_finite_check_can_be_skipped(tmp_path, monkeypatch):
    model = build(CASES["mixtral"])
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.router.weight"][0, 0] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setenv("MOE_ZOO_CHECK_FINITE", "0")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.isnan(loaded.model.layers[0].mlp.router.weight).any()


def test_plugin_module_without_init_is_refused_when_its_tensor_is_missing(tmp_path):
    """A third-party module that cannot say how to initialise itself: its missing tensor is named."""
    from torch import nn
    from zoo.moe.init import init_zoo_module, loading

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    module = Scale()
    with loading(), pytest.raises(MissingWeightsError, match="gain"):
        init_zoo_module(module, 0.02)
    module.gain._is_hf_initialized = True
    with loading():
        init_zoo_module(module, 0.02)  # everything loaded: nothing to refuse


def layout_error(tmp_path, edit):
    from zoo.moe.layout import LayoutError

    model = build(CASES["qwen2-shared-experts"])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config["zoo_layout"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LayoutError) as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    return str(info.value)


@pytest.mark.parametrize("edit, expected", [
    (lambda lay: lay[0].update(router="topk-sofmax"), r"zoo_layout\[0\]\.router: no router component named "
                                                       r"'topk-sofmax'; did you mean 'topk-softmax'"),
    (lambda lay: lay[2].pop("experts_options"), r"zoo_layout\[2\]\.experts_options: missing"),
    (lambda lay: lay[0].update(num_experts_per_tok=99), r"zoo_layout\[0\]\.num_experts_per_tok: must be in \[1"),
    (lambda lay: lay[0].update(num_experts="6"), r"zoo_layout\[0\]\.num_experts: must be int"),
    (lambda lay: lay[0]["experts_options"].update(hidden_size=32),
     r"zoo_layout\[0\]\.experts_options\.hidden_size: 32, but the model's hidden_size is 64"),
    (lambda lay: lay[2]["experts_options"].update(activation="not-an-activation"), r"zoo_layout\[2\]\.experts_options: unknown "
                                                                      r"activation"),
    (lambda lay: lay[0]["router_options"].update(temperature=2), r"zoo_layout\[0\]\.router_options: unknown option"),
    (lambda lay: lay.__setitem__(1, "dense"), r"zoo_layout\[1\]: must be an object or null"),
    (lambda lay: lay.append(None), r"zoo_layout has 4 entries for 3 decoder layers"),
])
def test_layout_errors_name_the_entry_and_field(tmp_path, edit, expected):
    assert re.search(expected, layout_error(tmp_path, edit))


def test_layout_problems_are_reported_together(tmp_path):
    def two(lay):
        lay[0].update(router="nope")
        lay[2].update(num_experts_per_tok=0)
    message = layout_error(tmp_path, two)
    assert "zoo_layout[0].router" in message and "zoo_layout[2].num_experts_per_tok" in message


def test_streamed_layer_with_nan_is_refused_and_nothing_written(tmp_path):
    from zoo.io.checkpoint import CheckpointError
    import zoo.editing.stream

    tiny_native("mixtral").save_pretrained(tmp_path / "native")
    tensors = load_file(tmp_path / "native" / "model.safetensors")
    key = next(k for k in tensors if k.startswith("model.layers.1.") and "experts" in k)  # native key names
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, tmp_path / "native" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"NaN or inf in model\.layers\.1\.mlp"):
        zoo.editing.stream.convert(tmp_path / "native", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zoo_load_of_a_native_checkpoint_with_inf_is_refused(tmp_path):
    tiny_native("mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError, match=r"model\.norm\.weight"):
        zoo.load(tmp_path)


def test_a_clamp_bound_may_be_infinite_but_never_nan():
    """Gemma 4's clipped linears store +-inf bounds (no clipping); a NaN bound, an inf in a larger tensor, or an
    inf in a tensor not named as a bound is still refused."""
    from zoo.io.finite import non_finite

    inf = float("inf")
    ok = [("audio.linear.input_min", torch.tensor(-inf)), ("audio.linear.output_max", torch.tensor(inf))]
    bad = [("audio.linear.input_max", torch.tensor(float("nan"))), ("x.clip_max", torch.tensor([inf, 1.0])),
           ("x.bias", torch.tensor(inf)), ("x.maximum", torch.tensor(-inf))]
    assert non_finite(ok + bad) == [name for name, _ in bad]
