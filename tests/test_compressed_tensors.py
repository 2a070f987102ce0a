"""compressed-tensors export (zoo.export(model, path, format="compressed-tensors")): int8 experts and linear layers
as W8A16 pack-quantized in the family's own checkpoint layout, symmetric int4 (quantize(symmetric=True)) as W4A16
group-wise. A fresh Python process that never imports zoo loads each folder with transformers' own compressed-tensors
support: its weights are bit-exact the zoo model's (the float weights the native export of the dequantized model
holds) and its logits the zoo model's; the packed codes are the zoo's own. What the format has no exact form for is
refused before anything is written. Also here: the quantize compressor's symmetric option (its checks, its grid
against a naive reference, and the default grid unchanged)."""
import copy
import hashlib
import json
import os
import re
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
from zoo.io.compressed_tensors_export import NotCompressedTensorsExportable

IDS = torch.tensor([[5, 17, 30, 42, 7, 100, 9, 64, 23, 2, 77, 3]])
# (model, quantize options): the shipped Mixtral's experts; quantize(targets="all") on each family (Qwen2-MoE: a dense
# layer and float shared experts; DeepSeek-V3: MLA projections and a dense layer)
# symmetric int4 (W4A16): Mixtral's experts alone; Qwen3-MoE's experts and attention (targets="all"), one group size
SYMMETRIC = {"bits": 4, "group_size": 32, "symmetric": True}
CASES = {
    "zoo-tiny-moe": ("zoo-tiny-moe", {}),
    **{family: (family, {"targets": "all"}) for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                                           "deepseek_v3")},
    "mixtral-w4a16": ("mixtral", SYMMETRIC),
    "qwen3_moe-w4a16": ("qwen3_moe", {**SYMMETRIC, "targets": "all"}),
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
    return zoo.apply(model, "quantize", **{"bits": 8, **options})


def dequantized_twin(model, linears: bool = True):
    """The same model with every quantized part (the experts only, unless ``linears``) as the float weights it
    stands for (the zoo's reference)."""
    from zoo.moe.layout import moe_layers, set_block, sync_layout
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
                patch.setattr("zoo.io.compressed_tensors_export.SHARD_BYTES", 200_000)
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
    ("4-bit experts", lambda m: zoo.apply(m, "quantize", bits=4, group_size=32),
     "integer zero point.*quantize with symmetric=True"),
    ("4-bit layers", lambda m: zoo.apply(m, "quantize", bits=4, group_size=32, targets="all"),
     "integer zero point.*quantize with symmetric=True"),
    ("3-bit experts", lambda m: zoo.apply(m, "quantize", bits=3, group_size=32), "read 4 and 8 bits"),
    ("3-bit symmetric", lambda m: zoo.apply(m, "quantize", bits=3, group_size=32, symmetric=True),
     "read 4 and 8 bits.*bits=4 and symmetric=True"),
    # the experts' groups are 32 (the expert width 96), the attention's 64: W4A16 has one group size
    ("symmetric, two group sizes", lambda m: zoo.apply(m, "quantize", bits=4, symmetric=True, targets="all"),
     "groups of 32 but .* of 64.*one group size"),
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
    from zoo.io.atomic import SaveTargetError

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


# ------------------------------------------------------------------------------------- symmetric int4 (W4A16)

def test_symmetric_int4_is_written_as_w4a16_with_the_zoos_codes(exported):
    """The experts' and linear layers' codes q (w = q s, -8..7) and bf16 scales, group-wise, with no zero point."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from zoo.moe.quantized_linear import QuantizedLinear

    cases, _ = exported
    for name in ("mixtral-w4a16", "qwen3_moe-w4a16"):
        q = json.load(open(f"{cases[name]['folder']}/config.json"))["quantization_config"]
        [group] = q["config_groups"].values()
        assert group["targets"] == ["Linear"] and group["format"] == q["format"] == "pack-quantized"
        assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")} == \
            {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}

    def zoo_codes(w, scale_zero):  # the zoo's q and s of one matrix [N, K]: w = q s exactly, zero 0
        s = scale_zero.float()[..., 0].t()
        assert torch.equal(scale_zero[..., 1].float(), torch.zeros_like(s).t())
        q = w.view(w.shape[0], -1, 32) / s[..., None]
        assert torch.equal(q, q.round()) and q.min() >= -8 and q.max() <= 7
        return q.view_as(w).to(torch.int8), s

    model, folder = cases["mixtral-w4a16"]["model"], cases["mixtral-w4a16"]["folder"]
    experts = model.model.layers[1].mlp.experts
    inter, hidden = experts.intermediate_size, experts.hidden_size
    seen = set()
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert not any(k.endswith("weight_zero_point") for k in f.keys())  # symmetric: no zero point at all
        for e in (0, 3):
            gate_up, down = experts.dequantized(e)
            codes_gu, s_gu = zoo_codes(gate_up, experts.stored("gate_up", 4)[1][e])
            codes_dn, s_dn = zoo_codes(down, experts.stored("down", 4)[1][e])
            for part, codes, scale in (("w1", codes_gu[:inter], s_gu[:inter]), ("w3", codes_gu[inter:], s_gu[inter:]),
                                       ("w2", codes_dn, s_dn)):
                key = f"model.layers.1.block_sparse_moe.experts.{e}.{part}"
                packed, shape = f.get_tensor(f"{key}.weight_packed"), tuple(f.get_tensor(f"{key}.weight_shape"))
                assert packed.dtype == torch.int32 and shape == tuple(codes.shape)
                assert packed.shape[-1] == shape[1] // 8  # eight 4-bit codes per int32 word
                assert torch.equal(unpack_from_int32(packed, 4, shape), codes)
                assert torch.equal(f.get_tensor(f"{key}.weight_scale"), scale)  # float32: the bf16 scales exactly
                seen |= set(codes.unique().tolist())
    assert {-8, 7} <= seen  # both ends of the signed range are used

    model, folder = cases["qwen3_moe-w4a16"]["model"], cases["qwen3_moe-w4a16"]["folder"]
    linear = model.model.layers[0].self_attn.q_proj
    assert isinstance(linear, QuantizedLinear) and linear.bits == 4
    codes, scale = zoo_codes(linear.dequantized(), linear.weight_scale_zero)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        key = "model.layers.0.self_attn.q_proj"
        assert torch.equal(unpack_from_int32(f.get_tensor(f"{key}.weight_packed"), 4, tuple(codes.shape)), codes)
        assert torch.equal(f.get_tensor(f"{key}.weight_scale"), scale)


def test_symmetric_int4_beside_an_int8_fallback_is_refused(tmp_path):
    """DeepSeek-V3's q_a_proj (24 outputs) has no 4-bit layout and stays int8: one scheme cannot hold both."""
    model = zoo.convert(tiny_native("deepseek_v3")).float().eval()
    zoo.apply(model, "quantize", **SYMMETRIC, targets="all")
    with pytest.raises(NotCompressedTensorsExportable, match="is 4-bit but .*q_a_proj is 8-bit: the checkpoint holds one scheme"):
        zoo.export(model, tmp_path / "out", format="compressed-tensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options, message", [
    # a wrong type: zoo.apply's option check (from the annotation), or the compressor's own when built directly
    ({"bits": 4, "symmetric": "yes"}, r"symmetric'?( of quantize)? must be (True or False|bool), got 'yes'"),
    ({"bits": 4, "symmetric": 1}, r"symmetric'?( of quantize)? must be (True or False|bool), got 1"),
    ({"bits": 4, "dtype": "bitmod", "symmetric": True}, re.escape("symmetric=True applies to dtype='int'")),
    ({"bits": 8, "symmetric": True}, re.escape("symmetric=True changes nothing at bits=8")),
    ({"bits": 4, "group_size": "adaptive", "symmetric": True}, re.escape("symmetric=True needs a fixed group_size")),
])
def test_the_symmetric_option_is_checked_before_the_model_is_touched(options, message):
    from zoo.components.registry import registry

    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message) as error:
        zoo.apply(model, "quantize", **options)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):
        registry.get("compressor", "quantize").obj(**options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# the default grid's codes and bf16 scale/zero at 2, 3 and 4 bits (``default_grid_digest``), as quantize_grouped gave
# them before the symmetric option existed
DEFAULT_GRID = "083d121901d3b0e718ec40bfa03a20bf648800dc0e8a7e3fc9b400066575a7ad"


def default_grid_digest(quantize) -> str:
    h = hashlib.sha256()
    for bits in (2, 3, 4):
        w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits)) * 0.05
        _, scale_zero, codes = quantize(w, 32, bits)
        h.update(codes.to(torch.uint8).numpy().tobytes())
        h.update(scale_zero.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def test_the_default_grid_is_unchanged():
    """Without symmetric the codes are the asymmetric ones of before, bit for bit, and the recipe reads as before."""
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts, quantize_grouped

    assert default_grid_digest(quantize_grouped) == DEFAULT_GRID
    assert default_grid_digest(lambda w, g, b: quantize_grouped(w, g, b, symmetric=False)) == DEFAULT_GRID
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    _, scale_zero, codes = quantize_grouped(w, 32, 4)  # the documented form: (q - 8) s + z, z = min + 8 s
    g = w.view(48, 4, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    assert torch.equal(codes, ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).int().view(48, 128))
    assert torch.equal(scale_zero, torch.stack([scale.t(), (lo + 8 * scale).t()], -1).bfloat16())
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 96)
    plain, explicit = (QuantizedExperts.from_dense(dense, [4, 3, 2, 8], 32, **kw) for kw in ({}, {"symmetric": False}))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), explicit.state_dict().values()))
    models = [zoo.apply(zoo.convert(tiny_native("mixtral")).eval(), "quantize", bits=4, group_size=32, **kw)
              for kw in ({}, {"symmetric": False})]
    assert models[0].config.zoo_recipe[-1]["options"] == {"bits": 4, "group_size": 32}  # as older recipes read
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_symmetric_experts_run_as_a_naive_dequantize_then_matmul(bits):
    """The zoo's forward on symmetric experts (its int4 kernels, 2/3 bits through their int4 working copy) against
    float experts holding q s built here from the codes; every weight within half a step of its original (no code
    clipped), and the stored pack standing for q s exactly."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts, quantize_grouped

    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 96)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    experts = QuantizedExperts.from_dense(dense, bits, group_size=32, symmetric=True)
    naive, half = SwiGLUExperts(4, 64, 96), 2 ** (bits - 1)
    with torch.no_grad():
        for e in range(4):
            for i, (w, target) in enumerate(((dense.gate_up_proj[e], naive.gate_up_proj),
                                             (dense.down_proj[e], naive.down_proj))):
                n, k = w.shape
                _, scale_zero, codes = quantize_grouped(w, 32, bits, symmetric=True)
                q = codes.view(n, k // 32, 32) - half  # the signed codes
                assert q.min() >= -half and q.max() <= half - 1
                s = scale_zero.float()[..., 0].t()[..., None]  # [N, K/32, 1]
                assert torch.equal(scale_zero[..., 1].float(), (8 - half) * scale_zero[..., 0].float())  # 0 at 4 bits
                ref = (q.float() * s).view(n, k)
                assert bool(((ref - w).view(n, k // 32, 32).abs() <= s / 2 * (1 + 1e-6)).all())
                assert torch.equal(experts.dequantized(e)[i], ref)
                target[e] = ref
    x = torch.randn(12, 64)
    routing = Routing(torch.rand(12, 2), torch.randint(0, 4, (12, 2)))
    with torch.no_grad():
        out, want = experts(x, routing), naive(x, routing)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_a_symmetric_linear_runs_as_a_naive_dequantize_then_matmul():
    from zoo.moe.quantized import quantize_grouped
    from zoo.moe.quantized_linear import QuantizedLinear

    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48)
    linear = QuantizedLinear.from_linear(dense, 4, 32, symmetric=True)
    _, scale_zero, codes = quantize_grouped(dense.weight.detach(), 32, 4, symmetric=True)
    assert torch.equal(linear.weight_scale_zero, scale_zero) and not scale_zero[..., 1].any()
    ref = ((codes.view(48, 2, 32) - 8).float() * scale_zero.float()[..., 0].t()[..., None]).view(48, 64)
    assert torch.equal(linear.dequantized(), ref)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, ref, dense.bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [SYMMETRIC, {"bits": 3.5, "allocation": "alphaq", "group_size": 32,
                                                 "symmetric": True}])
def test_quantize_symmetric_records_itself_and_survives_a_save(tmp_path, options):
    """The recipe records symmetric=True; every sub-8-bit group is stored as q s (zero (8 - 2**(b-1)) s: 0 at 4
    bits), also after save and load, where the logits are the same."""
    from zoo.moe.layout import moe_layers

    model = zoo.apply(zoo.convert(tiny_native("mixtral")).float().eval(), "quantize", **options)
    assert model.config.zoo_recipe[-1]["options"]["symmetric"] is True
    model.save_pretrained(tmp_path / "m")
    loaded = zoo.load(str(tmp_path / "m"), dtype=torch.float32).eval()
    assert loaded.config.zoo_recipe[-1]["options"]["symmetric"] is True
    widths = set()
    for m in (model, loaded):
        for _, moe in moe_layers(m):
            for b in moe.experts.widths:
                widths.add(b)
                for proj in ("gate_up", "down"):
                    if b < 8:
                        sz = moe.experts.stored(proj, b)[1].float()
                        assert torch.equal(sz[..., 1], (8 - 2 ** (b - 1)) * sz[..., 0]), (b, proj)
    assert 4 in widths
    ids = IDS % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
