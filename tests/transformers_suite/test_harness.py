"""The harness itself: each variant really tests the classes it names (cheap; part of the default run)."""
import pytest
import torch

from transformers_suite.families import FAMILIES, native_classes, native_tester
from transformers_suite.skips import SKIPS
from transformers_suite.zoo_variants import zoo_classes_of, zoo_heads_of, zoo_tester


@pytest.mark.parametrize("family", FAMILIES)
def test_variants_build_the_classes_they_name(family):
    from zoo.moe.layout import moe_layers
    from zoo.moe import SparseMoE

    native = native_tester(family)(parent=None)
    zoo_t = zoo_tester(family)(parent=None)
    assert native.causal_lm_class is native_classes(family)["causal_lm_class"]
    assert (zoo_t.config_class, zoo_t.base_model_class, zoo_t.causal_lm_class) == tuple(zoo_classes_of(family))
    with torch.random.fork_rng():
        native_model = native.causal_lm_class(native.get_config())
        zoo_model = zoo_t.causal_lm_class(zoo_t.get_config())
    assert not any(isinstance(m, SparseMoE) for m in native_model.modules())
    assert type(zoo_model) is zoo_t.causal_lm_class and zoo_model.config.model_type == f"zoo_{family}"
    assert moe_layers(zoo_model), "the zoo variant should run the zoo's own MoE blocks"
    assert zoo_model.config.to_dict()["num_hidden_layers"] == native_model.config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_variant_has_the_heads_the_zoo_makes(family):
    zoo_t = zoo_tester(family)(parent=None)
    for role, head in zoo_heads_of(family).items():
        assert getattr(zoo_t, role) is head
        if head is not None:
            assert head.config_class is zoo_t.config_class and head.__name__ == "Zoo" + native_classes(family)[role].__name__


def test_every_skip_has_a_reason():
    assert all(isinstance(r, str) and len(r) > 10 for r in SKIPS.values())


def test_skip_patterns_match_variant_family_and_test(monkeypatch):
    from transformers_suite import skips

    monkeypatch.setattr(skips, "SKIPS", {"zoo/*/test_foo_*": "because"})
    assert skips.reason_for("zoo", "mixtral", "test_foo_0_fp16") == "because"
    assert skips.reason_for("native", "mixtral", "test_foo_0_fp16") is None
    assert skips.reason_for("zoo", "mixtral", "test_bar") is None


def test_full_only_keeps_one_of_each_parameterized_group():
    from transformers_suite.conftest import DEFAULT_KEEPS, full_only

    assert full_only("test_training_overfit") and full_only("test_eager_matches_sdpa_inference_00_fp16_pad_left")
    assert not any(full_only(name) for name in DEFAULT_KEEPS)
    assert not full_only("test_save_load")
