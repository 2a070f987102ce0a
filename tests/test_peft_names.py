"""PEFT as its users write it on zoo models: ``LoraConfig(target_modules=["gate"])`` (or the family's own router
name, and its expert names) tunes the router and the experts as on the native model; the result is LoRA on the
router's weight, checked against the router rebuilt by hand from the LoRA factors; quantized experts are refused
by name with the model untouched; a fresh process that never imports zoo does the same on a saved folder."""
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

import zoo
from test_remote_code import foreign
from tiny import tiny_native
from zoo.architectures.peft_names import ExpertTargetMissing

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
IDS = torch.tensor([[5, 9, 17, 33, 2, 64, 100, 7]])


def zoo_model(family: str):
    torch.manual_seed(0)
    return zoo.convert(tiny_native(family)).float().eval()


def lora_delta(peft_model, path: str) -> torch.Tensor:
    """scaling * B @ A of the LoRA on the parameter at ``path`` (a ParamWrapper's, read off its modules)."""
    wrapper = peft_model.get_submodule(path)
    A, B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    return wrapper.scaling["default"] * (B @ A)


@pytest.mark.parametrize("family, names, params", [
    ("mixtral", ["gate", "w1", "w3", "w2"], {"router.weight", "gate_up_proj", "down_proj"}),
    ("qwen2_moe", ["gate", "gate_proj", "up_proj", "down_proj"], {"router.weight", "gate_up_proj", "down_proj"}),
    ("olmoe", ["gate"], {"router.weight"}),
    ("gpt_oss", ["router"], {"router.weight"}),
])
def test_native_names_tune_the_zoo_router_and_experts(family, names, params):
    model = zoo_model(family)
    with torch.no_grad():
        base = model(input_ids=IDS).logits
    peft_model = get_peft_model(model, LoraConfig(target_modules=names, r=2, init_lora_weights=False))
    config = peft_model.peft_config["default"]
    assert set(config.target_parameters) == params and not config.target_modules
    out = peft_model(input_ids=IDS).logits
    assert (out - base).abs().max() > 1e-3  # the adapter changes the model
    out.float().pow(2).mean().backward()
    tuned = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert tuned and all("lora_" in n for n in tuned)
    assert any(".router." in n and "lora_A" in n and p.grad.abs().sum() > 0
               for n, p in peft_model.named_parameters() if p.grad is not None)
    assert sum(1 for n in tuned if ".router." in n) == 2 * len(zoo.moe.layout.moe_layers(model))  # A and B per layer


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gate_lora_is_the_router_with_weight_plus_b_a(family):
    """Reference: a copy of the model whose routers' weights are W + s B A, set by hand."""
    model = zoo_model(family)
    import copy
    reference = copy.deepcopy(model)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["gate"], r=4, lora_alpha=8, init_lora_weights=False))
    with torch.no_grad():
        for i, moe in zoo.moe.layout.moe_layers(reference):
            path = f"base_model.model.model.layers.{i}.mlp.router"
            moe.router.weight += lora_delta(peft_model, path)
        want = reference(input_ids=IDS).logits
        got = peft_model(input_ids=IDS).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        merged = peft_model.merge_and_unload()
        assert type(merged.model.layers[0].mlp.router).__name__ == type(reference.model.layers[0].mlp.router).__name__
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, rtol=0, atol=1e-5)


def test_the_shared_expert_gate_is_not_the_router():
    """Qwen2-MoE's shared-expert sigmoid gate is also a module called ``gate`` in the zoo block; ``gate`` means the
    router, as on the native model (whose shared gate is ``shared_expert_gate``)."""
    peft_model = get_peft_model(zoo_model("qwen2_moe"), LoraConfig(target_modules=["gate"], r=2))
    wrapped = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "lora_" not in n.rpartition(".")[2]]
    assert wrapped and all(n.endswith(".mlp.router") for n in wrapped)


def test_lora_on_quantized_experts_is_refused_and_the_model_is_untouched():
    model = zoo.apply(zoo_model("mixtral"), "quantize", bits=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ExpertTargetMissing, match=r"layer 0's experts are QuantizedExperts .* hold no down_proj, "
                                                   r"gate_up_proj"):
        get_peft_model(model, LoraConfig(target_modules=["gate", "w1", "w3", "w2"], r=2))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(model.model.layers[0].mlp.router).__name__ == "TopKSoftmax"
    # the router alone still works on the quantized model (its weight is float)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["gate", "q_proj"], r=2))
    assert set(peft_model.peft_config["default"].target_parameters) == {"router.weight"}


FOREIGN = """
import json, sys, torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
folder, out_dir, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    base = model(input_ids=ids).logits
peft_model = get_peft_model(model, LoraConfig(target_modules=["gate", "q_proj"], r=2, init_lora_weights=False))
with torch.no_grad():
    tuned = peft_model(input_ids=ids).logits
peft_model.save_pretrained(out_dir)
fresh = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
reloaded = PeftModel.from_pretrained(fresh, out_dir)
with torch.no_grad():
    again = reloaded(input_ids=ids).logits
cfg = peft_model.peft_config["default"]
print("RESULT " + json.dumps({"params": sorted(cfg.target_parameters), "modules": sorted(cfg.target_modules),
      "changed": (tuned - base).abs().max().item(), "reload": (again - tuned).abs().max().item(),
      "zoo": "zoo" in sys.modules}))
"""


def test_a_fresh_process_tunes_the_gate_of_a_saved_zoo_folder(tmp_path):
    zoo_model("mixtral").save_pretrained(tmp_path / "m")
    out = foreign(FOREIGN, tmp_path / "m", tmp_path / "adapter", json.dumps(IDS.tolist()), cwd=tmp_path)
    assert out["params"] == ["router.weight"] and out["modules"] == ["q_proj"]
    assert out["changed"] > 1e-3 and out["reload"] == 0.0
    assert out["zoo"]  # the folder's own code imported moe-zoo, the script did not
