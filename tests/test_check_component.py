"""zoo.testing.check_component on every first-party component (options that really change the model), and on toy
routers with the reload bugs it must catch (tests/checker_toys.py). Everything is checked in one batch, so one
fresh process reloads all the saved models."""
import sys
from pathlib import Path

import pytest

import zoo
from zoo.editing.snapshot import Fingerprint
from zoo.testing import TINY, check_component, check_components, tiny_model

# kind:name -> options that change the model
OPTIONS = {
    "adapter:ubmoe": {"bi_steps": 2, "router_steps": 2, "batch_size": 4,
                      "data": [[3 + (5 * i + j) % 61 for j in range(12)] for i in range(8)]},
    "adapter:earth-adapter": {"dim": 4, "cutoff_ratio": 0.5},
    "adapter:zero-init-attention": {"prompts": 2, "prompt": "non-linear", "layers": 1},
    "router:token-hash": {"score": "sigmoid"},
    "router:expert-choice": {"capacity_factor": 1.5},
    "router:gemma4-topk": {"top_k": 1},
    "router:inkling-topk": {"route_scale": 2.0},
    "router:top1-capacity": {"expert_capacity": 2},
    "router:top2-capacity": {"eval_capacity_fraction": 0.25, "batch_prioritized": True},
    "router:hierarchical-modality": {"top_groups": 1},
    "router:language-conditioned": {"context_size": 16},
    "router:mixture-of-heads": {"heads_per_token": 0.5},
    "router:otp": {"keep_threshold": 0.9},
    "router:remix": {"num_samples": 2},
    "router:scored-topk": {"score": "sigmoid"},
    "router:sigmoid-bias": {"routed_scaling_factor": 2.0},
    "router:sparsemixer": {"jitter_eps": 0.1},
    "router:steer": {"disable": {"1": [0]}},
    "router:top-p": {"p": 0.7},
    "router:topk-softmax": {"top_k": 1},
    "router:adamoe": {"routed_scale": 0.5},
    "router:uncertainty-aware": {"samples": 2, "dropout": 0.2},
    "router:zaya-mlp": {"router_hidden_size": 16},
    "router:product-key": {"split": "tokens"},
    "compressor:channel-topk": {"budget": 0.5},
    "compressor:hc-smoe": {"num_experts": 3},
    "compressor:hodge-cover": {"num_experts": 3, "sparsity": 0.25},
    "compressor:moe-svd": {"ratio": 0.5},
    "compressor:prune-frequency": {"num_experts": 3},
    "compressor:prune-group": {"group": "vision", "num_experts": 2},
    "compressor:prune-reap": {"num_experts": 3},
    "compressor:quantize": {"bits": 4, "group_size": 32},
    "compressor:sub-moe": {"num_experts": 3},
    "adapter:ewa": {"collapse": True},
    "adapter:lora-experts": {"r": 2},
    "adapter:mixture-of-loras": {"num_loras": 3, "r": 2},
    "adapter:moefy": {"num_experts": 4},
    "adapter:replora": {"r": 2, "hidden": 8},
    "adapter:roma": {"lam": 2.0, "last_layers": 1},
    "adapter:upcycle": {"num_experts": 4, "noise": 0.1},
    "experts:channel-topk": {"budget": 0.5},
    "experts:factored": {"rank_gate_up": 4, "rank_down": 4, "num_u": 2},
    "experts:mlp": {"activation": "relu2"},
    "experts:mofme": {"film": "hidden"},
    "experts:modality-groups": {"group_sizes": [2, 1, 1]},
    "experts:quantized": {"bits": 3, "group_size": 32},
    "experts:quantized-lookup": {"bits": 3, "group_size": 32},
    "experts:quantized-mlp": {"bits": 3, "group_size": 32},
    "experts:swiglu": {"bias": True},
}
# more checks of one component: keys that are not kind:name
EXTRA = {
    "quantize mixed widths": {"name": "quantize", "options": {"bits": 5, "allocation": "alphaq", "group_size": 32}},
    "quantize 8 bits": {"name": "quantize", "options": {"bits": 8, "group_size": 32}, "families": ["mixtral"]},
    "quantize pmq": {"name": "quantize", "options": {"bits": 6, "allocation": "pmq", "group_size": 32},
                     "families": ["qwen2_moe"]},
    "mixture-of-loras learned": {"name": "mixture-of-loras", "options": {"num_loras": 2, "r": 2, "router": "learned",
                                                                         "top_k": 1, "target": "q_proj,o_proj"},
                                 "families": ["gpt_oss"]},
    "steer force": {"name": "steer", "options": {"force": {"2": [5]}, "disable": {"1": [0, 1]}},
                    "families": ["deepseek_v3"]},
    "upcycle adamoe": {"name": "upcycle", "options": {"num_experts": 4, "top_k": 1, "router": "adamoe"}},
}
SPECIAL = {
    # prune-group scores experts on the multimodal batches it draws itself: it takes no token-id calibration
    "compressor:prune-group": {"families": ["zoo_mm"], "calibration": None},
    # on zoo_mm it does not survive a reload: checked apart (KNOWN_BUG)
    "router:mixture-of-heads": {"families": ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]},
    # ungated experts: none of the built-in tiny families has them; a model name is built by architecture_model
    "experts:quantized-mlp": {"model": "nemotron_h"},
}
# Families each check is expected to skip, with the zoo's refusal (the default: the dense model, for MoE steps).
# Pinned, so that a component that stops fitting a family is noticed rather than skipped in silence.
MOE = {"mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "zoo_mm"}  # refused by steps that make an MoE of a dense model
DENSE_EXPERTS = {"mistral", "zoo_mm"}  # no MoE; modality-group experts (zoo_mm)
NO_QKV = {"mistral", "deepseek_v3", "zoo_mm"}  # no q_proj/k_proj/v_proj: MLA attention, zoo_mm's fused qkv
SKIPPED = {
    "adapter:ewa": DENSE_EXPERTS, "adapter:lora-experts": DENSE_EXPERTS, "adapter:mixture-of-loras": NO_QKV,
    "adapter:moefy": MOE, "adapter:replora": NO_QKV, "adapter:upcycle": MOE, "adapter:roma": {"mistral"},
    "adapter:zero-init-attention": {"mistral", "zoo_mm"}, "adapter:ubmoe": MOE,
    "adapter:earth-adapter": {"mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "mistral"},  # zoo_mm's vision only
    **{f"compressor:{n}": DENSE_EXPERTS for n in ("channel-topk", "hc-smoe", "hodge-cover", "moe-svd",
                                                 "prune-frequency", "prune-reap", "quantize", "sub-moe")},
    "compressor:prune-group": set(), "router:mixture-of-heads": set(),
    **{key: set() for key in ("quantize 8 bits", "quantize pmq", "mixture-of-loras learned", "steer force")},
    "upcycle adamoe": MOE,
    "quantize mixed widths": DENSE_EXPERTS, "experts:channel-topk": DENSE_EXPERTS, "experts:quantized": DENSE_EXPERTS,
    "experts:quantized-lookup": DENSE_EXPERTS, "experts:quantized-mlp": set(),
    "experts:modality-groups": {"mistral", "qwen2_moe", "deepseek_v3", "zoo_mm"},  # group_sizes sum to 4 experts
    "router:steer": {"mistral", "qwen2_moe", "zoo_mm"},  # layer 1 is dense; zoo_mm's router is no steer base
    "router:product-key": {"mistral", "qwen2_moe", "deepseek_v3", "zoo_mm"},  # 6 and 8 experts: no square count
    "experts:mofme": {"mistral", "gpt_oss"},  # GPT-OSS: biased, clamped experts (mofme shares a plain SwiGLU FFN)
}
KNOWN_BUG = {"name": "mixture-of-heads", "options": {"heads_per_token": 0.5}, "families": ["zoo_mm"]}
TOYS = {
    "toy-scaled": {}, "toy-uninitialised": {}, "toy-cast-on-reload": {}, "toy-unsaved-option": {"sharp": True},
    "toy-wrong-reference": {},
}


def first_party() -> list[str]:
    return sorted(f"{c['kind']}:{c['name']}" for c in zoo.list_components() if c["distribution"] == "moe-zoo")


def architecture_model(name):
    """A tiny native model of a family without a built-in one (tests/families/tiny_configs.py)."""
    from tests.families.test_generic_families import native_model

    return native_model(name)


@pytest.fixture(scope="module")
def reports(one_thread):
    checks = {}
    for key in first_party():
        kind, name = key.split(":")
        if kind == "architecture":
            checks[key] = {"name": key, "model": None if name in TINY else architecture_model(name)}
        elif key in OPTIONS:  # (one without is reported by test_every_first_party_component_is_checked)
            checks[key] = {"name": key, "options": OPTIONS[key], **SPECIAL.get(key, {})}
            if isinstance(checks[key].get("model"), str):
                checks[key]["model"] = architecture_model(checks[key]["model"])
    checks.update(EXTRA)
    checks["known bug"] = KNOWN_BUG
    checks["given model"] = {"name": "topk-softmax", "options": {"top_k": 1}, "model": GIVEN}
    checks.update({name: {"name": name, "options": options, "families": ["mixtral", "deepseek_v3"]}
                   for name, options in TOYS.items()})
    checks["third party"] = {"name": "example-switch-top1", "families": ["mixtral", "deepseek_v3"]}
    with pytest.MonkeyPatch.context() as mp:  # the example third-party plugin, not installed
        mp.syspath_prepend(str(Path(__file__).parent / "plugin_example"))
        out = check_components(list(checks.values()), plugins=["checker_toys", "moe_zoo_example"], strict=False)
    sys.modules.pop("moe_zoo_example", None)  # imported from its folder: not the installed one of other tests
    return dict(zip(checks, out))


GIVEN = tiny_model("olmoe")
GIVEN_BEFORE = Fingerprint(GIVEN)


def test_every_first_party_component_is_checked():
    """A new component must get options here (or it would go unchecked)."""
    missing = [k for k in first_party() if k not in OPTIONS and not k.startswith("architecture:")]
    assert not missing, f"no options to check {missing} with: add them to OPTIONS"


@pytest.mark.parametrize("key", first_party() + list(EXTRA))
def test_component_round_trips(reports, key):
    assert key in reports, f"no options to check {key} with: add them to OPTIONS"
    report = reports[key]
    assert "failure" not in report, report["failure"]
    assert report["families"]
    expected = SKIPPED.get(key, set() if key.startswith("architecture:") else {"mistral"})
    assert set(report["skipped"]) == expected, report["skipped"]
    if report["kind"] in ("experts", "architecture"):
        assert report["references"], "the experts' forward was not compared with their reference"


def test_mixture_of_heads_round_trips_on_zoo_mm(reports):
    assert "failure" not in reports["known bug"], reports["known bug"]["failure"]


def test_a_given_model_is_checked_alone_and_left_as_it_was(reports):
    report = reports["given model"]
    assert "failure" not in report, report["failure"]
    assert report["families"] == ["olmoe"] and not report["skipped"]
    assert GIVEN_BEFORE.same_as(GIVEN) and GIVEN.config.model_type == "olmoe"


def test_a_plugin_that_is_not_installed_is_checked_here_and_in_the_fresh_process(reports):
    report = reports["third party"]
    assert "failure" not in report, report["failure"]
    assert report["kind"] == "router" and report["families"] == ["mixtral", "deepseek_v3"]


def test_a_correct_toy_passes_and_its_reference_is_compared(reports):
    report = reports["toy-scaled"]
    assert "failure" not in report, report["failure"]
    assert report["families"] == ["mixtral", "deepseek_v3"] and report["references"] == ["ScaledRouter"]


@pytest.mark.parametrize("toy", ["toy-uninitialised", "toy-cast-on-reload", "toy-unsaved-option"])
def test_reload_bugs_are_caught(reports, toy):
    """A non-persistent buffer left uninitialised on load, an fp32 buffer cast to bf16 on load only, an option not
    passed up to Router.__init__: each changes the router's output after a load in a fresh process."""
    failure = reports[toy].get("failure", "")
    assert (f"{toy} on mixtral: after save_pretrained and a load in a fresh process the output of "
            "model.layers.0.mlp.router differs") in failure


def test_a_forward_that_differs_from_its_reference_is_caught(reports):
    failure = reports["toy-wrong-reference"].get("failure", "")
    assert "WrongReferenceRouter.forward vs its reference, weights: differ" in failure


def test_a_component_that_fits_no_model_fails_with_the_reasons():
    with pytest.raises(AssertionError, match=r"upcycle fits none of the models .*mixtral: TypeError: upcycle needs "
                                             r"a dense decoder of a family with an MoE sibling"):
        check_component("upcycle", families=["mixtral"], num_experts=4)


def test_an_unknown_name_fails_with_a_suggestion():
    with pytest.raises(AssertionError, match="did you mean 'topk-softmax'"):
        check_component("topk-sofmax")


def test_mixture_of_heads_wraps_an_attention_that_returns_a_tensor():
    """zoo_mm's attention returns its output alone, not transformers' (output, weights)."""
    import torch

    from zoo.testing import sample_inputs

    model = zoo.apply(tiny_model("zoo_mm"), "mixture-of-heads", heads_per_token=0.5)
    with torch.no_grad():
        assert torch.isfinite(model(**sample_inputs(model)).logits).all()
