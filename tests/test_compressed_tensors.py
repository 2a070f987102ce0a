"""compressed-tensors export (zoo.export(model, path, format="compressed-tensors")): int8 experts and linear layers
as W8A16 pack-quantized in the family's own checkpoint layout. A fresh Python process that never imports zoo loads
each folder with transformers' own compressed-tensors support: its weights are bit-exact the zoo model's (the float
weights the native export of the dequantized model holds) and its logits the zoo model's; the packed codes are the
zoo's own. What the format has no exact form for is refused before anything is written."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import zoo
from tiny import tiny_native
from zoo.compressed_tensors_export import NotCompressedTensorsExportable

IDS = torch.tensor([[5, 17, 30, 42, 7, 100, 9, 64, 23, 2, 77, 3]])
# (model, quantize options): the shipped Mixtral's experts; quantize(targets="all") on each family (Qwen2-MoE: a dense
# layer and float shared experts; DeepSeek-V3: MLA projections and a dense layer)
CASES = {
    "zoo-tiny-moe": ("zoo-tiny-moe", {}),
    **{family: (family, {"targets": "all"}) for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                                           "deepseek_v3")},
}

FRESH = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    results = {}
    for name, folder in json.loads(sys.argv[1]).items():
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        ids = load_file(folder + ".ids.safetensors")["ids"]
        with torch.no_grad():
            logits = model.eval()(ids).logits
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        save_file({"logits": logits, **weights}, folder + ".loaded.safetensors")
        results[name] = {"class": type(model).__name__, "quantized": bool(getattr(model, "is_quantized", False)),
                         **{k: sorted(map(str, v)) for k, v in info.items()}}
    results["zoo_imported"] = sorted(m for m in sys.modules if m.split(".")[0].startswith("zoo"))
    print("RESULTS " + json.dumps(results))
""")


def quantized_model(source: str, options: dict):
    model = (zoo.load(source, dtype=torch.float32) if source == "zoo-tiny-moe"
             else zoo.convert(tiny_native(source)).float()).eval()
    return zoo.apply(model, "quantize", bits=8, **options)


def dequantized_twin(model, linears: bool = True):
    """The same model with every quantized part (the experts only, unless ``linears``) as the float weights it
    stands for (the zoo's reference)."""
    from zoo.layout import moe_layers, set_block, sync_layout
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if linears and isinstance(module, QuantizedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantized()
            if module.bias is not None:
                linear.bias.data = module.bias.detach().clone()
            twin.set_submodule(name, linear)
    for i, moe in moe_layers(twin):
        ex = moe.experts
        if not isinstance(ex, QuantizedExperts):
            continue
        dense = SwiGLUExperts(ex.num_experts, ex.hidden_size, ex.intermediate_size, ex.activation)
        gate_up, down = zip(*(ex.dequantized(e) for e in range(ex.num_experts)))
        dense.gate_up_proj.data, dense.down_proj.data = torch.stack(gate_up), torch.stack(down)
        set_block(twin, i, moe.with_parts(experts=dense))
    sync_layout(twin)
    return twin


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each case exported (and its dequantized twin exported natively), then loaded in one fresh process."""
    root = tmp_path_factory.mktemp("ct")
    cases = {}
    for name, (source, options) in CASES.items():
        model = quantized_model(source, options)
        ids = IDS % model.config.vocab_size
        with pytest.MonkeyPatch.context() as patch:
            if name == "olmoe":  # written in several shards with their index
                patch.setattr("zoo.compressed_tensors_export.SHARD_BYTES", 200_000)
            folder = zoo.export(model, root / name, format="compressed-tensors")
        zoo.export(dequantized_twin(model), root / f"{name}.native")
        save_file({"ids": ids}, f"{folder}.ids.safetensors")
        with torch.no_grad():
            cases[name] = {"model": model, "folder": folder, "logits": model(ids).logits}
    run = subprocess.run([sys.executable, "-c", FRESH, json.dumps({n: c["folder"] for n, c in cases.items()})],
                         capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.split("RESULTS ", 1)[1])
    return cases, results


def test_the_fresh_process_never_imports_zoo(exported):
    _, results = exported
    assert results["zoo_imported"] == []


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_loads_the_zoo_weights_and_logits(exported, name):
    cases, results = exported
    case, result = cases[name], results[name]
    assert result["quantized"] and not result["class"].startswith("Zoo")  # the family's own class, quantized
    assert not (result["missing_keys"] or result["unexpected_keys"] or result["mismatched_keys"]), result
    loaded = load_file(f"{case['folder']}.loaded.safetensors")
    # the native export's weights as transformers reads them (its checkpoint names are the family's, e.g. Mixtral's
    # per-expert w1/w2/w3, which transformers fuses on load as it fuses the compressed-tensors experts)
    native = AutoModelForCausalLM.from_pretrained(f"{case['folder']}.native").state_dict()
    index = os.path.join(case["folder"], "model.safetensors.index.json")
    assert os.path.exists(index) == (name == "olmoe")
    for key, want in native.items():  # quantized weights bit-exact, float weights unchanged
        assert torch.equal(loaded[key], want), key
    config = case["model"].config
    if getattr(config, "tie_word_embeddings", False):
        assert torch.equal(loaded["lm_head.weight"], native["model.embed_tokens.weight"])
    diff = float((loaded["logits"] - case["logits"]).abs().max())
    scale = float(case["logits"].abs().max())
    print(f"{name}: max |logits - zoo logits| = {diff:.3g} (logits up to {scale:.3g})")
    assert diff <= 1e-5 * max(scale, 1.0), (diff, scale)


def test_the_checkpoint_holds_the_zoos_codes_per_expert_as_w8a16(exported):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    cases, _ = exported
    folder, model = cases["zoo-tiny-moe"]["folder"], cases["zoo-tiny-moe"]["model"]
    config = json.load(open(f"{folder}/config.json"))
    assert config["model_type"] == "mixtral" and "auto_map" not in config
    q = config["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "pack-quantized",
                                                                          "compressed")
    [group] = q["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == "pack-quantized"
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy")} == \
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    assert "lm_head" in q["ignore"] and "model.layers.0.self_attn.q_proj" in q["ignore"]  # the float layers
    experts = model.model.layers[2].mlp.experts
    codes, scales = experts.stored("gate_up", 8)
    inter = experts.intermediate_size
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert not any(k.endswith("gate_up_proj") for k in f.keys())  # split per expert, Mixtral's w1/w3/w2 names
        for e in (0, 5):
            for part, rows in (("w1", slice(0, inter)), ("w3", slice(inter, None))):
                key = f"model.layers.2.block_sparse_moe.experts.{e}.{part}"
                packed = f.get_tensor(f"{key}.weight_packed")
                assert packed.dtype == torch.int32 and tuple(f.get_tensor(f"{key}.weight_shape")) == (inter, 256)
                assert torch.equal(unpack_from_int32(packed, 8, (inter, 256)), codes[e, rows])
                assert torch.equal(f.get_tensor(f"{key}.weight_scale"), scales[e, rows, None].float())
        assert "model.layers.2.block_sparse_moe.gate.weight" in f.keys()


def test_linear_layers_are_quantized_and_the_float_ones_ignored(exported):
    from zoo.moe.quantized_linear import QuantizedLinear

    cases, _ = exported
    case = cases["qwen2_moe"]  # attention, a dense layer's MLP and the LM head quantized
    q = json.load(open(f"{case['folder']}/config.json"))["quantization_config"]
    with safe_open(f"{case['folder']}/model.safetensors", "pt") as f:
        keys = set(f.keys())
        head = f.get_tensor("lm_head.weight")
    quantized = {n: m for n, m in case["model"].named_modules() if isinstance(m, QuantizedLinear)}
    # vLLM builds the LM head unquantized: it is written as the float weight it stands for
    assert torch.equal(head, quantized.pop("lm_head").dequantized()) and "lm_head" in q["ignore"]
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"} <= set(quantized)
    for module in [*quantized, "model.layers.2.mlp.experts.3.gate_proj"]:
        assert {f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"} <= keys, module
        assert f"{module}.weight" not in keys and module not in q["ignore"]
    assert all(f"{module}.weight" in keys for module in q["ignore"])  # float, as transformers reads them


@pytest.mark.parametrize("label, make, reason", [
    ("4-bit experts", lambda m: zoo.apply(m, "quantize", bits=4, group_size=32), "integer zero point"),
    ("4-bit layers", lambda m: zoo.apply(m, "quantize", bits=4, group_size=32, targets="all"), "integer zero point"),
    ("3-bit experts", lambda m: zoo.apply(m, "quantize", bits=3, group_size=32), "read 4 and 8 bits"),
    ("mixed widths", lambda m: zoo.apply(m, "quantize", bits=6, allocation="random", group_size=32),
     "mixes expert widths"),
    ("float", lambda m: m, "nothing is quantized"),
    ("float experts", lambda m: dequantized_twin(zoo.apply(m, "quantize", bits=8, targets="all"), linears=False),
     "experts are float"),
])
def test_what_has_no_exact_form_is_refused_and_nothing_is_written(tmp_path, label, make, reason):
    model = make(zoo.convert(tiny_native("mixtral")).float().eval())
    with pytest.raises(NotCompressedTensorsExportable, match=reason):
        zoo.export(model, tmp_path / "out", format="compressed-tensors")
    assert list(tmp_path.iterdir()) == [], label


def test_fused_experts_with_biases_are_refused(tmp_path):
    model = zoo.apply(zoo.convert(tiny_native("gpt_oss")).float().eval(), "quantize", bits=8)
    with pytest.raises(NotCompressedTensorsExportable, match="biases"):
        zoo.export(model, tmp_path / "out", format="compressed-tensors")
    assert list(tmp_path.iterdir()) == []


def test_the_export_never_writes_into_the_folder_the_model_came_from(tmp_path):
    from zoo.atomic import SaveTargetError

    quantized_model("mixtral", {}).save_pretrained(tmp_path / "m")
    model = zoo.load(str(tmp_path / "m"))
    before = sorted(p.name for p in (tmp_path / "m").iterdir())
    with pytest.raises(SaveTargetError):
        zoo.export(model, tmp_path / "m" / "ct", format="compressed-tensors")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
    with pytest.raises(ValueError, match="compressed-tensors"):
        zoo.export(model, tmp_path / "x", format="compressed_tensors")


def test_cli_export_format_compressed_tensors(tmp_path):
    from zoo.cli import cli

    quantized_model("mixtral", {"targets": "all"}).save_pretrained(tmp_path / "m")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "m"), str(tmp_path / "ct"),
                                      "--format", "compressed-tensors"])
    assert result.exit_code == 0, result.output
    config = json.load(open(tmp_path / "ct" / "config.json"))
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    result = CliRunner().invoke(cli, ["export", "zoo-tiny-moe", str(tmp_path / "float"),
                                      "--format", "compressed-tensors"])
    assert result.exit_code == 1 and "nothing is quantized" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "float").exists()
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "m"), str(tmp_path / "s"), "--stream",
                                      "--format", "compressed-tensors"])
    assert result.exit_code == 2 and not (tmp_path / "s").exists()
