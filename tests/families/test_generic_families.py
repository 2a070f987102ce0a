"""Every family the generic adapter converts (``zoo.architectures.families.GENERIC``), from a tiny random model
built with the family's own config class: converted losslessly (logits within 1e-5 relative in fp32, greedy
tokens equal), saved and reloaded through the family's Auto class, exported back to the native format, and
changed once by a compressor, a router and the quantizer of the zoo; the head layer-by-layer evaluation puts on the
last layer's output gives the family's own logits (or the family is refused there)."""
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import zoo
from tests.families.tiny_configs import model_class, tiny_config
from zoo.architectures.families import EXCEPTIONS, FIRST_PARTY, GENERIC
from zoo.moe.layout import moe_layers

AUTO = {"causal-lm": AutoModelForCausalLM, "image-text-to-text": AutoModelForImageTextToText}
# families whose forward is not a language model's over input_ids: tested in a file of their own (Diffusion Gemma
# denoises a canvas, sampled at random unless given: tests/test_diffusion_gemma.py); ERNIE-4.5-VL's layout lists
# per-modality parts beside its decoder layers, which layer-by-layer evaluation and streaming do not take
# (tests/test_ernie4_5_vl.py); Qwen3-Omni's top model has no forward of its own, its two decoders are checked one by
# one (tests/test_qwen3_omni.py)
OWN_TESTS = {"diffusion_gemma", "ernie4_5_vl_moe", "qwen3_omni_moe"}
CONVERTED = sorted(t for t in GENERIC if t not in EXCEPTIONS and t not in OWN_TESTS and t in CONFIG_MAPPING_NAMES)


# parameters transformers leaves uninitialised (torch.empty) when it builds the model: drawn here, seeded, or a test
# reads whatever the memory held (a NaN there failed the conversion check of a fresh CI process now and then)
UNINITIALISED = {"qwen3_omni_moe": ("talker.", ".mlp.experts.")}


def native_model(model_type):
    config = tiny_config(model_type)
    text = config.get_text_config()
    for key in ("moe_intermediate_size", "intermediate_size", "expert_intermediate_size"):
        if getattr(text, key, None) == 16:  # the quantizer's groups are 32 wide
            setattr(text, key, 32)
    torch.manual_seed(0)
    model = model_class(model_type)(config).eval()
    parts = UNINITIALISED.get(model_type)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if parts and all(part in name for part in parts):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def input_ids(model, rows=2, length=10):
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(3, min(vocab, 100), (rows, length), generator=torch.Generator().manual_seed(1))


def logits(model, ids):
    with torch.no_grad():
        if type(model).__name__ in BROKEN_FORWARD:
            forward = inspect.unwrap(type(model).forward)
            return forward(model, input_ids=ids, use_cache=False, return_dict=False)[0].float()
        return model(input_ids=ids, use_cache=False).logits.float()


# native classes whose forward fails in transformers 5.24 (Llama 4 multimodal reads `image_outputs` off its language
# model's output, and a tuple fails in its output-capturing decorator): their reference is the forward's own code
# below its decorators, with return_dict=False, and greedy decoding a loop over it (their generate runs the forward);
# the zoo model's forward runs (zoo.architectures.llama4_vl)
BROKEN_FORWARD = {"Llama4ForConditionalGeneration"}


def greedy(model, ids, new_tokens=4):
    with torch.no_grad():
        if type(model).__name__ not in BROKEN_FORWARD:
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        eos = model.generation_config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []))
        done = torch.zeros(len(ids), dtype=torch.bool)
        for _ in range(new_tokens):  # as generate: greedy, rows past their end-of-sequence padded with 0
            token = torch.where(done, 0, logits(model, ids)[:, -1].argmax(-1))
            ids, done = torch.cat([ids, token[:, None]], dim=1), done | torch.isin(token, eos)
            if done.all():
                break
        return ids


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", CONVERTED)
def test_converts_losslessly_and_round_trips(model_type, tmp_path):
    native = native_model(model_type)
    ids = input_ids(native)
    want, want_tokens = logits(native, ids), greedy(native, ids[:1])
    model = zoo.convert(native)
    assert moe_layers(model), "no MoE layer converted"
    got, last = logits_and_last_hidden(model, ids)
    assert rel(got, want) <= 1e-5
    assert torch.equal(greedy(model, ids[:1]), want_tokens)
    check_head(model_type, model, last, got)

    model.save_pretrained(tmp_path / "zoo")
    back = AUTO[GENERIC[model_type]].from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model)
    assert back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back, ids), want) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = model_class(model_type).from_pretrained(tmp_path / "native").eval()
    assert type(again) is model_class(model_type)
    assert rel(logits(again, ids), want) <= 1e-5


@pytest.mark.parametrize("model_type", CONVERTED)
def test_zoo_components_apply(model_type, tmp_path):
    model = zoo.convert(native_model(model_type))
    ids = input_ids(model, rows=4, length=16)
    n = moe_layers(model)[0][1].num_experts
    k = moe_layers(model)[0][1].top_k
    steps = ["prune-frequency", "expert-choice", "quantize"]
    # every family calibrates, those whose layers take positional inputs or hand each other more than hidden states too
    zoo.apply(model, "prune-frequency", calibration=[ids], num_experts=max(k, n - 1))
    assert all(moe.num_experts == max(k, n - 1) for _, moe in moe_layers(model))
    zoo.apply(model, "expert-choice")
    ungated = moe_layers(model)[0][1].experts.name == "mlp"  # Nemotron-H: up and down only, no gate
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert moe_layers(model)[0][1].experts.name == ("quantized-mlp" if ungated else "quantized")
    out = logits(model, ids)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AUTO[GENERIC[model_type]].from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == steps
    assert rel(logits(back, ids), out) <= 1e-5


def moe_model_types() -> set[str]:
    """Config classes of the installed transformers with an expert count (their own or a sub-config's)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    found = set()
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:
            continue
        classes, todo = [], [cls]
        while todo:  # sub-configs of sub-configs too (an omni model's thinker holds its text config)
            c = todo.pop()
            classes.append(c)
            todo += [s for s in (getattr(c, "sub_configs", {}) or {}).values() if isinstance(s, type)]
        if any(k in getattr(c, "__dataclass_fields__", {}) for c in classes for k in keys):
            found.add(model_type)
    return found


def test_every_moe_family_is_listed():
    """The reviewed list covers every MoE config transformers ships: converted, or excepted with a reason."""
    listed = set(FIRST_PARTY) | set(GENERIC) | set(EXCEPTIONS)
    missing = moe_model_types() - listed
    assert not missing, f"MoE families missing from zoo.architectures.families: {sorted(missing)}"
    assert all(reason.strip() for reason in EXCEPTIONS.values())
    assert not set(FIRST_PARTY) & set(GENERIC)


VISION_LANGUAGE = [t for t in CONVERTED if GENERIC[t] == "image-text-to-text"]


@pytest.mark.parametrize("model_type", VISION_LANGUAGE)
def test_multimodal_routing_applies_to_a_vision_language_models_moe_layers(model_type, tmp_path):
    """MoHAVE's two-level routing over expert groups, on the language model's MoE layers of a real VLM family;
    the vision tower is untouched and the model reloads through AutoModelForImageTextToText."""
    model = zoo.convert(native_model(model_type))
    vision_before = {k: v.clone() for k, v in model.state_dict().items() if "language_model" not in k and "lm_head" not in k}
    n = moe_layers(model)[0][1].num_experts
    zoo.apply(model, "hierarchical-modality", group_sizes=[n // 2, n - n // 2], top_groups=1)
    assert all(moe.router.name == "hierarchical-modality" for _, moe in moe_layers(model))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in vision_before.items())
    ids = input_ids(model)
    out = logits(model, ids)
    model.save_pretrained(tmp_path / "mm")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "mm").eval()
    assert rel(logits(back, ids), out) <= 1e-5


def test_zoo_load_takes_a_vision_language_checkpoint_through_its_auto_class(tmp_path):
    model_type = VISION_LANGUAGE[0]
    native_model(model_type).save_pretrained(tmp_path / "native")
    model = zoo.load(str(tmp_path / "native"))
    assert type(model).__name__.startswith("Zoo") and moe_layers(model)
    assert type(model) is AutoModelForImageTextToText._model_mapping[type(model.config)]


def test_zoo_load_says_why_an_excepted_family_stays_native(tmp_path):
    torch.manual_seed(0)
    model_class("nllb-moe")(tiny_config("nllb-moe")).save_pretrained(tmp_path / "native")
    with pytest.warns(UserWarning, match=r"not converted: transformers 5.24's NllbMoeExperts .* without conversion"):
        model = zoo.load(str(tmp_path / "native"))
    assert not hasattr(type(model), "zoo_family")


def test_calibration_ids_are_checked_against_a_vision_language_models_text_vocabulary():
    model = zoo.convert(native_model(VISION_LANGUAGE[0]))
    vocab = model.config.get_text_config().vocab_size
    with pytest.raises(ValueError, match=f"vocabulary has {vocab} entries"):
        zoo.apply(model, "prune-frequency", calibration=[torch.full((1, 8), vocab + 5)], num_experts=3)


# families whose forward acts between the last decoder layer and the final norm (hyper-connection streams merged,
# Inkling 2's final input): layer-by-layer evaluation refuses them
NO_HEAD = {"deepseek_v4", "glm5_next", "hy_v4", "hy_v4_vl", "inkling2", "inkling2_loop", "inkling2_loop_text",
           "inkling2_text", "qwen4_exp", "qwen4_exp_text"}


def logits_and_last_hidden(model, ids):
    """The model's logits and its last decoder layer's output on ``ids``."""
    from zoo.moe.layout import decoder_layers

    seen = {}

    def keep(module, args, out):  # returns None: the layer's output stays as it is
        seen["h"] = out[0] if isinstance(out, tuple) else out

    hook = decoder_layers(model)[-1].register_forward_hook(keep)
    try:
        return logits(model, ids), seen["h"]
    finally:
        hook.remove()


def check_head(model_type, model, last, want):
    """What ``zoo.editing.stream.evaluate`` computes after running the layers itself (final norm, LM head, the
    family's logit scaling or soft-cap) is the family's own forward's logits, or the family is refused up front."""
    from zoo.editing.head import NoHead, head_logits

    if model_type in NO_HEAD:
        with pytest.raises(NoHead, match="between its last layer and its final norm"):
            head_logits(model, last)
        return
    with torch.no_grad():
        assert rel(head_logits(model, last).float(), want) <= 1e-6
