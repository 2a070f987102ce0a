"""quantize on ungated experts (``mlp``: Nemotron-H, Switch Transformers): ``quantized-mlp`` experts hold the same
packed codes as the gated ``quantized`` kind, match their dequantized reference (outputs and input gradients, eager
and compiled), and the compressor applies, saves and reloads them with its widths, allocations and group sizes."""
import contextlib

import pytest
import torch
from test_switch_transformers import IDS as SWITCH_IDS, logits as switch_logits, native_model as switch_model
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

import zoo
from tests.families.test_generic_families import input_ids, logits, native_model
from zoo.architectures.lookup import NotExportable
from zoo.moe import Routing, kernels
from zoo.moe.experts import MLPExperts, SwiGLUExperts
from zoo.moe.layout import moe_layers
from zoo.moe.quantized import QuantizedExperts, QuantizedMLPExperts


def dense_mlp(activation="relu2", seed=0):
    torch.manual_seed(seed)
    dense = MLPExperts(4, 64, 96, activation=activation)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    return dense


def dequantized_mlp(q: QuantizedMLPExperts) -> MLPExperts:
    """The plain ungated experts holding ``q``'s dequantized weights: the naive reference."""
    ref = MLPExperts(q.num_experts, q.hidden_size, q.intermediate_size, activation=q.activation)
    with torch.no_grad():
        for e in range(q.num_experts):
            ref.up_proj[e], ref.down_proj[e] = q.dequantized(e)
    return ref


@pytest.mark.parametrize("bits", [[4, 4, 4, 4], [8, 8, 8, 8], [2, 3, 4, 8]])
@pytest.mark.parametrize("activation", ["relu2", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_reference_outputs_and_gradients(bits, activation, dtype):
    q = QuantizedMLPExperts.from_dense(dense_mlp(activation), bits, group_size=32).to(dtype)
    x = torch.randn(12, 64, dtype=dtype, requires_grad=True)
    indices = torch.randint(0, 4, (12, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(12, 2, dtype=dtype)
    out = q(x, Routing(weights, indices))
    out.float().pow(2).sum().backward()
    xr = x.detach().float().requires_grad_(True)
    ref = dequantized_mlp(q)(xr, Routing(weights.float(), indices))
    ref.pow(2).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    torch.testing.assert_close(out.float(), ref.detach(), **tol)
    gtol = tol if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * xr.grad.abs().max().item())
    torch.testing.assert_close(x.grad.float(), xr.grad, **gtol)


@pytest.mark.parametrize("bits,symmetric", [(8, False), (4, False), (4, True)])  # int8 is symmetric anyway
def test_codes_and_scales_are_those_of_the_gated_kind(bits, symmetric):
    """The same weight quantized as the up half of a gated expert and as an ungated up projection: equal stacks."""
    dense = dense_mlp()
    gated = SwiGLUExperts(4, 64, 96)
    with torch.no_grad():
        gated.gate_up_proj.copy_(torch.cat([dense.up_proj, dense.up_proj], 1))
        gated.down_proj.copy_(dense.down_proj)
    q = QuantizedMLPExperts.from_dense(dense, bits, group_size=32, symmetric=symmetric)
    g = QuantizedExperts.from_dense(gated, bits, group_size=32, symmetric=symmetric)
    for e in range(4):
        up, down = q.dequantized(e)
        gate_up, gated_down = g.dequantized(e)
        assert torch.equal(up, gate_up[96:]) and torch.equal(down, gated_down)
    assert q.options() == {**dense.options(), "bits": [bits] * 4, "group_size": 32}
    weights = 2 * 4 * 64 * 96
    assert q.num_parameters() == dense.num_parameters() == weights
    scales = 4 * 4 * (96 + 64) if bits == 8 else weights // 32 * 4  # fp32 per row; bf16 scale and zero per group
    assert q.nbytes() == weights * bits // 8 + scales


@torch.no_grad()
@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_compiled_inference_matches_the_reference(path):
    """A compiled decode step: the zoo's kernel reads the packed experts in place, or (without it) the selected
    experts' packed weights are gathered; empty slots ignored."""
    if path == "kernel" and not kernels.load():
        pytest.skip(f"kernel unavailable: {kernels.unavailable_reason()}")
    torch._dynamo.reset()
    q = QuantizedMLPExperts.from_dense(dense_mlp(), [2, 4, 8, 8], group_size=32)
    x = torch.randn(2, 64)
    indices = torch.tensor([[0, 3], [2, 4]])  # 4 == num_experts: an empty slot
    weights = torch.tensor([[0.7, 0.3], [1.0, float("nan")]])
    q(x, Routing(weights, indices))  # the eager prefill builds the 2/3-bit kernel stacks
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with kernels.turned_off() if path == "gather" else contextlib.nullcontext():
        out = torch.compile(lambda x, w, i: q(x, Routing(w, i)), fullgraph=True, backend=backend)(x, weights, indices)
    assert ("zoo.moe_gemv.default" in ops) == (path == "kernel"), ops
    want = torch.zeros_like(x)
    for t in range(2):
        for e, w in zip(indices[t].tolist(), weights[t].tolist()):
            if e < 4:
                up, down = q.dequantized(e)
                want[t] += w * (q._act(x[t] @ up.t()) @ down.t())
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_nemotron_h_quantizes_saves_and_reloads(tmp_path):
    model = zoo.convert(native_model("nemotron_h"))
    ids = input_ids(model)
    before = logits(model, ids)
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(type(moe.experts) is QuantizedMLPExperts and moe.experts.bits == [8] * 4 for _, moe in moe_layers(model))
    out = logits(model, ids)
    assert ((out - before).norm() / before.norm()) < 0.01  # int8 stays close to the float model
    model.save_pretrained(tmp_path / "q")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert back.config.zoo_layout == model.config.zoo_layout
    assert torch.equal(logits(back, ids), out)
    with pytest.raises(NotExportable, match="'quantized-mlp' experts"):  # the native checkpoint holds floats
        zoo.export(back, tmp_path / "native")


def test_switch_transformers_quantizes_both_stacks_saves_and_reloads(tmp_path):
    model = zoo.convert(switch_model())
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert [moe.experts.name for _, moe in moe_layers(model)] == ["quantized-mlp"] * 4
    out = switch_logits(model)
    model.save_pretrained(tmp_path / "q")
    back = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "q").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["quantize"]
    assert torch.equal(switch_logits(back), out)
    with torch.no_grad():
        assert torch.equal(back.generate(input_ids=SWITCH_IDS, max_new_tokens=3, do_sample=False),
                           model.generate(input_ids=SWITCH_IDS, max_new_tokens=3, do_sample=False))


def test_mixed_widths_and_adaptive_groups_reload_in_a_fresh_process():
    """AlphaQ's allocation over 4 and 8 bits, checked by zoo.testing: the experts against their reference, and the
    model saved, then loaded in a fresh process with the same outputs."""
    from zoo.testing import check_component

    report = check_component("quantize", model=native_model("nemotron_h"), bits=6, allocation="alphaq",
                             widths=[4, 8], group_size="adaptive")
    assert report["families"] == ["nemotron_h"] and report["references"] == ["QuantizedMLPExperts"]


def test_lookup_types_are_refused_for_ungated_experts_before_anything_changes():
    model = zoo.convert(native_model("nemotron_h"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="quantizes gated .swiglu. experts only"):
        zoo.apply(model, "quantize", bits=4, group_size=32, dtype="bitmod")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bits,symmetric", [(8, False), (4, True)])
def test_ungated_experts_export_to_compressed_tensors_and_load_in_transformers(bits, symmetric, tmp_path):
    from tests.families.tiny_configs import model_class

    model = zoo.convert(native_model("nemotron_h"))
    ids = input_ids(model)
    zoo.apply(model, "quantize", bits=bits, group_size=32, symmetric=symmetric)
    out = logits(model, ids)
    zoo.export(model, tmp_path / "ct", format="compressed-tensors")
    back = model_class("nemotron_h").from_pretrained(tmp_path / "ct").eval()
    assert ((logits(back, ids) - out).norm() / out.norm()) <= 1e-5


def test_switch_transformers_is_refused_by_the_compressed_tensors_export_with_the_reason(tmp_path):
    from zoo.io.compressed_tensors_export import NotCompressedTensorsExportable

    model = zoo.apply(zoo.convert(switch_model()), "quantize", bits=8, group_size=32)
    with pytest.raises(NotCompressedTensorsExportable, match="switch_transformers: transformers 5.24 loads no"):
        zoo.export(model, tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()
