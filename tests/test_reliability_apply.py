"""Transactional apply: every check first; any failure leaves the model bit-identical and of its class; a
step that would do nothing, or something other than asked, is an error."""
import pytest
import torch

import zoo
from zoo.editing.apply import NoChange
from zoo.io.finite import NonFiniteWeightsError
from zoo.editing.layerwise import LayerInputs
from tiny import tiny_config, tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")
CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]


def state(model):
    """Everything a failed step must leave as it was: classes, config, every tensor's value."""
    return (type(model).__name__, type(model.model).__name__, type(model.config).__name__,
            model.config.to_json_string(), {k: v.clone() for k, v in model.state_dict().items()},
            [type(m).__name__ for m in model.modules()])


def assert_unchanged(model, before):
    after = state(model)
    assert after[:4] == before[:4] and after[5] == before[5]
    assert after[4].keys() == before[4].keys()
    assert all(torch.equal(after[4][k], before[4][k]) for k in before[4])


@pytest.fixture(params=["native", "zoo"])
def model(request):
    native = tiny_native("mixtral")
    return native if request.param == "native" else zoo.convert(native)


@pytest.mark.parametrize("step, options, message", [
    ("prune-reap", {"num_experts": 2, "calibration": []}, "calibration data is empty"),
    ("prune-reap", {"num_experts": 2, "calibration": [torch.rand(2, 8)]}, "integer tensor"),
    ("prune-reap", {"num_experts": 2, "calibration": [torch.tensor([[1, 2, 999]])]}, r"\[1, 999\].*128 entries"),
    ("prune-reap", {"num_experts": 2, "calibration": [torch.tensor([[-1, 2]])]}, r"\[-1, 2\]"),
    ("prune-reap", {"num_experts": 2, "calibration": [torch.zeros(0, 4, dtype=torch.long)]}, "shape"),
    ("prune-reap", {"num_experts": 2, "calibration": ["", "  "]}, "texts are all empty"),
    ("prune-reap", {"num_experts": 2, "calibration": {"domain": "code", "tokns": 64}}, "unknown calibration spec"),
    ("prune-reap", {"num_experts": 2, "calibration": {"domain": "klingon"}}, "domain must be"),
    ("prune-reap", {"num_experts": 2, "calibration": 42}, "unsupported calibration"),  # refused when read
    ("prune-reap", {"num_experts": 2.0, "calibration": CAL}, "must be int, got 2.0"),
    ("prune-reap", {"num_experts": 9, "calibration": CAL}, "only 4 experts"),
    ("prune-reap", {"num_experts": True, "calibration": CAL}, "must be int|positive integer"),
    ("topk-softmax", {"top_k": 2.7}, "integer"),
    ("topk-softmax", {"top_k": 5}, r"integer in \[1, 4\]"),
    ("topk-softmax", {"norm_topk_prob": "yes"}, "must be bool"),
    ("top-p", {"p": "0.9"}, "must be float"),
    ("steer", {"disable": {99: [0]}}, r"layers \[99\].*MoE layers are \[0, 1\]"),
    ("steer", {"force": {"7": [1]}}, r"layers \[7\]"),
    ("quantize", {"bits": 4, "group_size": 48}, "group_size"),
    ("moe-svd", {"ratio": 1.5, "calibration": CAL}, "ratio"),
    ("lora-experts", {"r": 2.5}, "must be int"),
    ("mixture-of-heads", {"heads_per_token": "half"}, "must be float"),
    ("prune-frequency", {"num_experts": 4, "calibration": CAL}, "changes nothing"),
    ("topk-softmax", {}, "changes nothing"),
])
def test_refused_step_leaves_the_model_bit_identical(model, step, options, message):
    before = state(model)
    with pytest.raises((ValueError, TypeError), match=message):
        zoo.apply(model, step, **options)
    assert_unchanged(model, before)


def test_failure_in_the_middle_of_a_step_restores_a_native_model(monkeypatch):
    """The native model was converted before the compressor failed on its last layer: it comes back native."""
    from zoo_compressors.prune_reap import PruneReap

    model = tiny_native("mixtral")
    before = state(model)
    calls = []

    def fail_on_layer_1(self, index, block, inputs):
        calls.append(index)
        if index == 1:
            raise RuntimeError("out of memory, say")
        return original(self, index, block, inputs)

    original = PruneReap.compress_layer
    monkeypatch.setattr(PruneReap, "compress_layer", fail_on_layer_1)
    with pytest.raises(RuntimeError, match="out of memory"):
        zoo.apply(model, "prune-reap", calibration=CAL, num_experts=2)
    assert calls == [0, 1]
    assert_unchanged(model, before)
    assert type(model).__name__ == "MixtralForCausalLM" and not hasattr(model.config, "zoo_layout")
    model(CAL[0][:1])  # and it still runs as a native model


def test_failed_adapter_attach_restores_the_model(monkeypatch):
    from zoo_adapters.lora_experts import LoraExperts

    model = zoo.convert(tiny_native("mixtral"))
    before = state(model)

    def broken(self, m):
        for _, moe in zoo.moe.layout.moe_layers(m):
            moe.router = torch.nn.Identity()  # half-done surgery, then a failure
        raise RuntimeError("peft failed")

    monkeypatch.setattr(LoraExperts, "attach", broken)
    with pytest.raises(RuntimeError, match="peft failed"):
        zoo.apply(model, "lora-experts", r=2)
    assert_unchanged(model, before)


def test_a_step_that_cannot_follow_fails_before_calibration(monkeypatch):
    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "quantize", bits=8, group_size=32)
    before = state(model)

    def no_capture(*a, **k):
        raise AssertionError("calibration ran before the precondition check")

    monkeypatch.setattr(LayerInputs, "capture", no_capture)
    with pytest.raises(ValueError, match="'quantized' experts; prune-reap needs dense experts"):
        zoo.apply(model, "prune-reap", calibration=CAL, num_experts=2)
    assert_unchanged(model, before)


def test_zoo_model_without_moe_layers_is_refused():
    from zoo.architectures.factory import zoo_classes
    from zoo.components.registry import registry

    cfg_cls, _, lm_cls = zoo_classes(registry.get("architecture", "mixtral").obj)
    model = lm_cls(cfg_cls(**tiny_config("mixtral").to_dict()))
    for layer in model.model.layers:  # a zoo model whose layers are all dense
        layer.mlp = torch.nn.Identity()
    before = state(model)
    with pytest.raises(ValueError, match="has none"):
        zoo.apply(model, "quantize", bits=8, group_size=32)
    assert_unchanged(model, before)


def test_nan_weights_are_refused_before_the_step():
    model = zoo.convert(tiny_native("mixtral"))
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[0, 0, 0] = float("nan")
    before = state(model)
    with pytest.raises(NonFiniteWeightsError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all()
               for a, b in zip(state(model)[4].values(), before[4].values()))
    zoo.apply(model, "sigmoid-bias", check_finite=False)  # the scan can be skipped


def test_no_change_error_is_its_own_class():
    model = zoo.convert(tiny_native("mixtral"))
    with pytest.raises(NoChange):
        zoo.apply(model, "topk-softmax")


def test_recipe_grows_only_on_success():
    model = zoo.convert(tiny_native("mixtral"))
    with pytest.raises(ValueError):
        zoo.apply(model, "prune-reap", calibration=[], num_experts=2)
    assert model.config.zoo_recipe == []
    zoo.apply(model, "prune-reap", calibration=CAL, num_experts=2)
    assert [s["name"] for s in model.config.zoo_recipe] == ["prune-reap"]


def test_streamed_steer_checks_its_layers_before_writing(tmp_path):
    import zoo.editing.stream

    tiny_native("mixtral").save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match=r"layers \[99\]"):
        zoo.editing.stream.apply(tmp_path / "native", [("steer", {"disable": {99: [0]}})], tmp_path / "out")
    assert not (tmp_path / "out").exists()
