"""quantize(targets="all"): quantized linear layers (attention projections, dense MLPs, the LM head) against their
dequantized reference, outputs and gradients, eager and compiled (zoo::moe_gemv); the layer-at-a-time engine
hands them over; save/reload; GGUF keeps their codes."""
import copy

import pytest
import torch
from tiny import tiny_native
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe import kernels
from zoo.components import Compressor
from zoo.editing.layerwise import compress_in_memory
from zoo.moe.init import MissingWeightsError
from zoo.moe.quantized import QuantizedExperts
from zoo.moe.quantized_linear import QuantizedLinear

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 20])  # 20: the prefill path (int8 as float, int4 dequantised by the kernel)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_its_dequantized_weight(bits, rows, dtype):
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 48, bias=True)
    q = QuantizedLinear.from_linear(dense, bits, 64)
    # half a step: 1/254 (int8) or about 1/15 (a 4-bit group spans at most twice the largest weight) of the largest
    assert (q.dequantized() - dense.weight).abs().max() < (0.005 if bits == 8 else 0.07) * dense.weight.abs().max()
    q = q.to(dtype)
    w = q.dequantized()
    x = torch.randn(rows, 128, dtype=dtype, requires_grad=True)
    y = q(x)
    ref = x.detach().float() @ w.T + q.bias.detach().float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.detach().float(), ref, atol=tol * float(ref.abs().max()), rtol=0)
    y.float().pow(2).sum().backward()  # the input's gradient goes through the dequantized weight
    grad = (2 * y.detach().float()) @ w
    torch.testing.assert_close(x.grad.float(), grad, atol=tol * float(grad.abs().max()), rtol=0)


@pytest.mark.parametrize("bits,k", [(8, 128), (8, 24), (4, 128)])
def test_compiled_step_reads_it_with_the_kernel(bits, k):
    if not kernels.load():
        pytest.skip(f"zoo's kernel is not available: {kernels.unavailable_reason()}")
    torch.manual_seed(1)
    q = QuantizedLinear.from_linear(torch.nn.Linear(k, 64, bias=False), bits, 32 if k % 64 else 64)
    x = torch.randn(1, 2, k)
    calls = []
    real = kernels.moe_gemv

    def counting(*args, **kw):
        calls.append(args[4])
        return real(*args, **kw)

    with torch.no_grad():
        want = x @ q.dequantized().T
        torch._dynamo.reset()
        kernels.moe_gemv, saved = counting, kernels.moe_gemv
        try:
            got = torch.compile(q, backend="eager", fullgraph=True)(x)
        finally:
            kernels.moe_gemv = saved
    assert calls == [bits]
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_targets_all_quantizes_every_matrix_but_embeddings_and_routers_and_reloads(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))  # untied LM head
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
    zoo.apply(model, "quantize", bits=8, targets="all")
    attn = model.model.layers[0].self_attn
    assert all(isinstance(getattr(attn, p), QuantizedLinear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(model.model.layers[1].mlp.experts, QuantizedExperts)
    assert type(model.model.layers[1].mlp.router.weight) is torch.nn.Parameter  # routers stay in float
    step = model.config.zoo_recipe[-1]
    assert step["options"] == {"bits": 8, "targets": "all"} and step["results"]["linears"]["count"] == 2 * 4 + 1
    assert set(model.config.zoo_modules) == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                             for p in "qkvo"} | {"lm_head"}
    with torch.no_grad():
        out = model(input_ids=IDS).logits
    assert 0 < (out - ref).abs().max() < 0.05 * ref.abs().max()
    model.save_pretrained(tmp_path / "q")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert isinstance(loaded.lm_head, QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, out)
    with pytest.raises(ValueError, match="quantized"):  # native checkpoints hold float weights
        zoo.export(model, tmp_path / "native")


def test_a_tied_lm_head_and_shapes_without_a_4_bit_layout(tmp_path):
    """zoo-tiny-moe ties its LM head to the embeddings: it stays. DeepSeek's low-rank projections (24 outputs, or
    inputs of 24 and 16) have no 4-bit layout: they go to 8 bits, and the results say which."""
    tied = zoo.load("zoo-tiny-moe", dtype=torch.float32)
    zoo.apply(tied, "quantize", bits=4, targets="all")
    assert type(tied.lm_head) is torch.nn.Linear and tied.lm_head.weight is tied.model.embed_tokens.weight
    deepseek = zoo.convert(tiny_native("deepseek_v3"))
    zoo.apply(deepseek, "quantize", bits=4, group_size=32, targets="all")
    linears = deepseek.config.zoo_recipe[-1]["results"]["linears"]
    attn = deepseek.model.layers[0].self_attn
    assert attn.q_b_proj.bits == 8 and "model.layers.0.self_attn.q_b_proj" in linears["at_8_bits"]
    assert attn.q_a_proj.bits == 8 and attn.o_proj.bits == 4  # q_a_proj: 24 outputs, not a multiple of 16
    assert deepseek.model.layers[0].mlp.down_proj.bits == 4  # a dense layer's MLP too
    deepseek.save_pretrained(tmp_path / "d")
    with torch.no_grad():
        want = deepseek(input_ids=IDS).logits
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "d")(input_ids=IDS).logits, want)


class RefusesTheHead(Compressor):
    """Quantizes linears, but refuses the LM head in check_linear: nothing may change."""
    name = "refuses-the-head"
    targets_linears = True

    def compress_layer(self, index, block, inputs):
        return block

    def check_linear(self, name, linear):
        if name == "lm_head":
            raise ValueError("not the head")

    def compress_linear(self, name, linear):
        return QuantizedLinear.from_linear(linear, 8)


class FailsLate(RefusesTheHead):
    """Replaces layer 0's linears, then fails at the LM head: the model keeps every linear it had."""

    def check_linear(self, name, linear):
        pass

    def compress_linear(self, name, linear):
        if name == "lm_head":
            raise RuntimeError("late failure")
        return super().compress_linear(name, linear)


@pytest.mark.parametrize("step,error", [(RefusesTheHead, ValueError), (FailsLate, RuntimeError)])
def test_the_engine_checks_linears_first_and_swaps_them_in_last(step, error):
    model = zoo.convert(tiny_native("mixtral"))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error):
        compress_in_memory(model, [step()])
    assert all(type(m) is not QuantizedLinear for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_load_missing_packed_codes_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "quantize", bits=8, targets="all")
    model.save_pretrained(tmp_path / "q")
    shard = tmp_path / "q" / "model.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.o_proj.weight_int8"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match="weight_int8"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_quantized_model_reloads_bit_for_bit_also_under_device_maps(tmp_path, bits):
    """int8 row scales are made in fp32 and stay fp32 when the bf16 checkpoint loads (in bf16 a reloaded int8 model
    computed other logits); the same under accelerate's device maps, one layer offloaded to disk included."""
    model = zoo.apply(zoo.load("zoo-tiny-moe").eval(), "quantize", bits=bits, targets="all")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path / "q")
    last = len(model.model.layers) - 1
    disk = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
            **{f"model.layers.{i}": "disk" if i == last else "cpu" for i in range(last + 1)}}
    for device_map in (None, "auto", disk):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map=device_map,
                                                      offload_folder=tmp_path / "offload").eval()
        scales = {n: t.dtype for n, t in loaded.state_dict().items() if "scale" in n}
        assert scales and all(d == (torch.float32 if bits == 8 else torch.bfloat16) for d in scales.values())
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=IDS).logits, want), device_map
