"""lora-experts: the grouped forward against a naive reference (explicit W_e + scale * B_e A_e per expert),
PEFT save / load / merge round trips, option checking, and ``moe-zoo finetune`` on a tiny model."""
import json

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from tiny import tiny_native

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing

# isort: split
# (after ``import zoo``: importing a plugin module first would run the plugin hooks on a half-imported module)
from zoo_adapters.lora_experts import ZooPeftModel, load_adapter
from zoo_adapters.lora_grouped import ParamWrapper, gathered_forward, grouped_forward

pytestmark = pytest.mark.usefixtures("one_thread")


def randomize_lora(model, std=0.05, seed=1):
    """LoRA starts with B = 0 (no change): give B (and A) values so the update is real."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def naive(wrapper, hidden, routing):
    """Per token and slot: the expert with an explicit effective weight W_e + delta_e (PEFT's get_delta_weight)."""
    chain, w = {}, wrapper
    while isinstance(w, ParamWrapper):
        chain[w.parameter_name] = w.get_delta_weight("default")
        w = w.base_layer
    experts = wrapper.get_base_layer()
    gate_up = experts.gate_up_proj + chain.get("gate_up_proj", 0)
    down = experts.down_proj + chain.get("down_proj", 0)
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot, e in enumerate(routing.indices[t].tolist()):
            b1 = None if experts.gate_up_proj_bias is None else experts.gate_up_proj_bias[e]
            b2 = None if experts.down_proj_bias is None else experts.down_proj_bias[e]
            y = F.linear(experts.glu(F.linear(hidden[t], gate_up[e], b1)), down[e], b2)
            out[t] = out[t] + routing.weights[t, slot] * y
    return out


def lora_grads(wrapper):
    return [p.grad.clone() for n, p in wrapper.named_parameters() if "lora_" in n]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # gpt_oss: biases and the clamped SwiGLU
def test_grouped_forward_matches_naive_outputs_and_grads(family, monkeypatch):
    model = zoo.apply(zoo.convert(tiny_native(family)), "lora-experts", r=3, alpha=6).double()
    randomize_lora(model)
    _, moe = moe_layers(model)[0]
    wrapper = moe.experts
    assert isinstance(wrapper, ParamWrapper) and isinstance(wrapper.base_layer, ParamWrapper)
    torch.manual_seed(0)
    hidden = torch.randn(11, wrapper.get_base_layer().hidden_size, dtype=torch.float64, requires_grad=True)
    routing = moe.router(hidden.detach())
    routing = Routing(weights=routing.weights.detach(), indices=routing.indices, logits=None)

    with monkeypatch.context() as m:  # the grouped path never folds the update into a full weight
        m.setattr(torch.nn.utils.parametrize, "register_parametrization", None)
        got = wrapper(hidden, routing)
    got.square().sum().backward()
    got_grads, got_x = lora_grads(wrapper), hidden.grad.clone()
    wrapper.zero_grad()
    hidden.grad = None
    want = naive(wrapper, hidden, routing)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(hidden.grad, got_x, atol=1e-10, rtol=1e-9)
    assert len(got_grads) == 4 and all(g.abs().sum() > 0 for g in got_grads)
    for a, b in zip(got_grads, lora_grads(wrapper)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    # the decode (gather) path agrees too, for a few tokens
    lora = wrapper._grouped_factors()
    few = Routing(weights=routing.weights[:2], indices=routing.indices[:2], logits=None)
    torch.testing.assert_close(gathered_forward(wrapper.get_base_layer(), hidden[:2], few, lora),
                               grouped_forward(wrapper.get_base_layer(), hidden[:2], few, lora), atol=1e-10, rtol=1e-9)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny native Mixtral with the corpus tokenizer, saved where zoo.load can read it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


IDS = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44, 120, 7], [8, 21, 66, 12, 90, 2, 31, 77, 4, 19]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_peft_save_load_merge_export(tiny_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    model = zoo.apply(zoo.load(tiny_folder), "lora-experts", r=4)
    assert isinstance(model, ZooPeftModel) and model.config.zoo_recipe[-1]["name"] == "lora-experts"
    assert model.config.zoo_layout[0]["experts"] == "swiglu"  # the base layout; the adapter is PEFT's
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    randomize_lora(model.eval())
    want = logits(model)
    base = logits(zoo.load(tiny_folder))
    assert (want - base).abs().max() > 1e-3  # the adapter changes the model

    model.save_pretrained(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    plain = PeftModel.from_pretrained(zoo.load(tiny_folder), tmp_path / "adapter").eval()  # PEFT's folded path
    torch.testing.assert_close(logits(plain), want, atol=1e-5, rtol=1e-5)
    grouped = load_adapter(zoo.load(tiny_folder), tmp_path / "adapter").eval()
    assert isinstance(moe_layers(grouped)[0][1].experts, ParamWrapper)
    torch.testing.assert_close(logits(grouped), want, atol=1e-5, rtol=1e-5)

    merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), want, atol=1e-5, rtol=1e-5)
    zoo.export(merged, tmp_path / "native")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert json.loads((tmp_path / "native" / "config.json").read_text())["model_type"] == "mixtral"
    torch.testing.assert_close(logits(native), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{"r": 0}, {"r": 2.5}, {"alpha": -1}, {"targets": "up_proj"}, {"rank": 4},
                                     {"targets": "down_proj,down_proj"}])
def test_bad_options_leave_the_model_unchanged(options):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError):
        zoo.apply(model, "lora-experts", **options)
    assert not any(isinstance(m, ParamWrapper) for m in model.modules())
    assert model.config.zoo_recipe == [] and model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_only_down_proj_targeted():
    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "lora-experts", r=2, targets="down_proj")
    experts = moe_layers(model)[0][1].experts
    assert experts.parameter_name == "down_proj" and not isinstance(experts.base_layer, ParamWrapper)


def test_finetune_cli_trains_only_the_adapter_and_lowers_the_loss(tiny_folder, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from zoo.cli import cli

    out = tmp_path / "ft"
    result = CliRunner().invoke(cli, ["finetune", tiny_folder, "--adapter", "lora-experts:r=4,alpha=8",
                                      "--domain", "code", "--steps", "8", "--lr", "3e-2", "--batch-size", "4",
                                      "--seq-len", "64", "--windows", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "english" in result.output and "code" in result.output and "before" in result.output
    record = json.loads((out / "finetune.json").read_text())
    losses = [loss for _, loss in record["history"]]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert record["perplexity"]["after"]["code"] < record["perplexity"]["before"]["code"]
    weights = load_file(out / "adapter_model.safetensors")
    assert weights and all("lora_" in k for k in weights)  # the adapter only, never the base weights
    assert (out / "tokenizer.json").is_file()

    bad = CliRunner().invoke(cli, ["finetune", tiny_folder, "--adapter", "lora-experts:r=0", "--domain", "code",
                                   "--steps", "1", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 1 and "r must be a positive integer" in bad.output
    assert not (tmp_path / "bad").exists()


def test_adapter_lab_runs_a_short_finetune(tiny_folder, monkeypatch):
    """The Space's handler itself (build/launch/mentions are test_meta's): a table per domain and a figure."""
    from zoo.demos.spaces import load_app

    monkeypatch.setenv("MOE_ZOO_MODEL", tiny_folder)
    monkeypatch.setenv("MOE_ZOO_LAB_WINDOWS", "1")
    app = load_app("adapter-lab")
    app.build_demo()  # the adapter controls the handler checks options with
    update, fig = app.run("lora-experts", {"r": 2}, "code", 2, 1e-3)  # code: tokenized above
    table = update["value"]  # the table, shown with the first run
    assert [row[0] for row in table["data"]] == ["english", "code"]
    assert all(row[1] > 1 and row[2] > 1 for row in table["data"])
    assert len(fig.axes) >= 3
    with pytest.raises(Exception, match="r must be a positive integer"):
        app.run("lora-experts", {"r": 0}, "code", 1, 1e-3)
