"""Compiled decode (static cache + torch.compile through model.generate): the whole step is one graph,
and it decodes the same greedy tokens as eager code."""
import warnings

import pytest
import torch
from tiny import tiny_native

import zoo
from zoo.runtime.decode import generate

IDS = torch.tensor([[1, 17, 33, 5, 90, 12, 64, 3]])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def greedy(model, compile, backend="eager", n=12, ids=IDS):
    return generate(model, ids, max_new_tokens=n, min_new_tokens=n, compile=compile, backend=backend)


# GPT-OSS is left out: its sliding-window static cache guards on the Python length each step, so dynamo
# recompiles every token and fullgraph fails on the native transformers model just the same.
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_decode_step_is_one_graph_and_matches_eager(family):
    """fullgraph=True raises on any graph break (a host sync, data-dependent Python) in the decode step."""
    model = zoo.convert(tiny_native(family))
    eager = greedy(model, compile=False)
    compiled = greedy(model, compile=True)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the step really went through dynamo
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("options", [{"bits": 8}, {"bits": 4}, {"bits": 3, "allocation": "alphaq", "widths": [2, 3, 4, 8]}])
def test_quantized_experts_inside_the_compiled_step(options):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "quantize", group_size=32, **options)
    eager = greedy(model, compile=False)
    compiled = greedy(model, compile=True)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(compiled, eager)


@pytest.fixture(scope="module")
def shipped():
    tok = zoo.load_tokenizer("zoo-tiny-moe")
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    return zoo.load("zoo-tiny-moe").float().eval(), ids


def test_inductor_decode_matches_eager_on_the_shipped_model(shipped, one_thread):
    """Real inductor code for the decode step (fp32: bf16 fusions round differently and may flip a
    near-tied token after a few dozen steps)."""
    model, ids = shipped
    eager = greedy(model, compile=False, n=24, ids=ids)
    compiled = greedy(model, compile=True, backend="inductor", n=24, ids=ids)
    assert torch.equal(compiled, eager)


def test_zoo_fp32_greedy_matches_transformers(shipped):
    model, ids = shipped
    native = zoo.load("zoo-tiny-moe", convert=False).float().eval()
    assert type(native).__name__ == "MixtralForCausalLM"
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(ids, **kw), native.generate(ids, **kw))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_lean_greedy_loop_matches_generate(family):
    """zoo.runtime.decode.greedy (static cache, the model's compiled call, no generate bookkeeping) gives
    generate's greedy tokens, compiled in one graph or eager."""
    from zoo.runtime.decode import greedy as lean

    model = zoo.convert(tiny_native(family))
    eager = greedy(model, compile=False)
    assert torch.equal(lean(model, IDS, 12, compile=True, backend="eager"), eager)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(lean(model, IDS, 12, compile=False), eager)


def _quantized_experts(bits):
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 96, bias=True)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    return QuantizedExperts.from_dense(dense, bits, group_size=32)


@pytest.mark.parametrize("bits", [[8, 8, 8, 8], [4, 4, 4, 4], [2, 3, 4, 8]])
@torch.no_grad()
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_compiled_quantized_experts_read_in_place_and_match_the_dequantized_reference(bits, path):
    """Compiled inference runs the packed experts through the zoo's kernel (zoo::moe_gemv) or, without it,
    zoo::lowbit_experts (views of the selected experts for torch's kernels); no gather either way: one graph,
    and the dequantized reference's output, empty slots included."""
    import contextlib

    from zoo.moe import kernels
    from zoo.moe import Routing

    if path == "kernel" and not kernels.load():
        pytest.skip(f"kernel unavailable: {kernels.unavailable_reason()}")
    torch._dynamo.reset()

    q = _quantized_experts(bits)
    x = torch.randn(3, 64)
    indices = torch.tensor([[0, 3], [2, 4], [1, 2]])  # 4 == num_experts: an empty slot (top-p, expert-choice)
    weights = torch.tensor([[0.7, 0.3], [1.0, float("nan")], [0.5, 0.5]])  # an empty slot's weight is ignored
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with kernels.turned_off() if path == "torch" else contextlib.nullcontext():
        out = torch.compile(lambda x, w, i: q(x, Routing(w, i)), fullgraph=True, backend=backend)(x, weights, indices)
    op = "zoo.moe_gemv.default" if path == "kernel" else "zoo.lowbit_experts.default"
    assert op in ops and not any("index_select" in o for o in ops), ops
    ref = torch.zeros_like(x)
    for t in range(3):
        for e, w in zip(indices[t].tolist(), weights[t].tolist()):
            if e < 4:
                gu, dn = q.dequantized(e)
                h = x[t] @ gu.t() + q.gate_up_proj_bias[e]
                ref[t] += w * ((q.glu(h) @ dn.t()) + q.down_proj_bias[e])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, q(x, Routing(weights, indices)))  # and the eager sorted path


def test_lowbit_experts_op_registration():
    """Schema, fake (meta) implementation and dispatch of the custom op agree (torch.library.opcheck)."""
    from zoo.moe import Routing

    q = _quantized_experts([2, 4, 8, 8])
    args = q.in_place_args(torch.randn(2, 64), Routing(torch.rand(2, 2), torch.tensor([[0, 3], [1, 2]])))
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # inference-only: no autograd
    torch.library.opcheck(torch.ops.zoo.lowbit_experts.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_token_dispatch_gives_the_sorted_dispatch_numbers(dtype):
    """run_each (the in-place op's decode loop) reproduces run_sorted bit for bit, so a compiled step
    rounds expert outputs exactly as eager prefill code does."""
    from zoo.moe.dispatch import run_each, run_sorted
    from zoo.moe.experts import SwiGLUExperts

    torch.manual_seed(0)
    experts = SwiGLUExperts(4, 32, 48).to(dtype)
    x = torch.randn(3, 32, dtype=dtype)
    indices = torch.tensor([[3, 1], [4, 0], [1, 3]])  # 4: an empty slot
    weights = torch.rand(3, 2)
    with torch.no_grad():
        assert torch.equal(run_each(x, indices, weights, 4, experts.expert),
                           run_sorted(x, indices, weights, 4, experts.expert))


def test_a_copy_of_a_compiled_model_decodes_with_its_own_modules_after_apply():
    """transformers caches the compiled call on the model, and a deepcopy carries the original's; zoo.apply
    drops it, so the changed copy is compiled afresh instead of running the original's modules."""
    import copy

    model = zoo.convert(tiny_native("mixtral"))
    greedy(model, compile=True)  # compiles and caches model._compiled_call
    quantized = zoo.apply(copy.deepcopy(model), "quantize", bits=4, group_size=32)
    assert torch.equal(greedy(quantized, compile=True), greedy(quantized, compile=False))


def test_lean_greedy_stops_at_eos_as_generate_does(shipped):
    from zoo.runtime.decode import greedy as lean

    model, ids = shipped
    new = lean(model, ids, 16, compile=False)[0, ids.shape[1]:].tolist()
    eos = new[5]
    stop = new.index(eos)  # the first time the model emits it
    out = lean(model, ids, 16, compile=True, backend="eager", eos_token_id=eos)
    assert out.shape[1] == ids.shape[1] + stop + 1
    expected = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out, expected)


def test_generate_command_prints_the_continuation_and_its_speed():
    from click.testing import CliRunner

    from zoo.cli import cli

    prompt = "def add(a, b):"
    res = CliRunner().invoke(cli, ["generate", "zoo-tiny-moe", prompt, "--max-new-tokens", "8", "--no-compile",
                                   "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(prompt) and len(res.stdout.strip()) > len(prompt)
    assert "tok/s" in res.stderr
    bad = CliRunner().invoke(cli, ["generate", "zoo-tiny-mo", prompt])
    assert bad.exit_code != 0 and "zoo-tiny-moe" in bad.output  # a close match is suggested
    huge = CliRunner().invoke(cli, ["generate", "zoo-tiny-moe", prompt, "--max-new-tokens", "8", "--no-compile",
                                    "--threads", "1", "--huge-pages"])
    assert huge.exit_code == 0, huge.output
    assert huge.stdout == res.stdout and "weights on huge pages:" in huge.stderr  # the same text


def test_ahead_of_time_step_gives_eager_tokens_and_reads_the_models_own_weights(one_thread):
    """greedy's default step (AOTInductor): fp32 tokens equal eager, with the attention projections and LM head
    quantized too; built once per model and cache bucket (another prompt and length in it reuse the step); the library reads the model's tensors (no copy), so an in-place
    change to a weight shows in its next tokens; a new model (apply) builds its own."""
    from zoo.runtime.decode import CACHE_BUCKET, cache_length, greedy as lean
    from zoo.runtime.decode_aot import AotStep

    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "quantize", bits=8, targets="all")
    attention = model.config._attn_implementation
    before = lean(model, IDS, 12, compile=False)
    assert torch.equal(lean(model, IDS, 12), before)
    assert model.config._attn_implementation == attention  # the step's own attention was set for the export only
    length = cache_length(model, IDS.shape[1] + 12)
    assert length % CACHE_BUCKET == 0 or length == model.config.max_position_embeddings
    step = AotStep.of(model, 1, length)
    built = []
    real = AotStep.__init__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AotStep, "__init__", lambda self, *a: built.append(a[1:]) or real(self, *a))
        lean(model, IDS, 12)
        shorter = lean(model, IDS[:, :3], 7)  # another prompt and length in the same bucket: the same step
    assert not built and AotStep.of(model, 1, length) is step  # not rebuilt
    assert torch.equal(shorter, lean(model, IDS[:, :3], 7, compile=False))
    with torch.no_grad():
        model.lm_head.weight_scale.mul_(-1)  # every logit's sign flips: other tokens
    flipped = lean(model, IDS, 12, compile=False)
    assert not torch.equal(flipped, before)
    assert torch.equal(lean(model, IDS, 12), flipped) and AotStep.of(model, 1, length) is step


def test_cache_lengths_round_up_to_a_bucket_within_the_models_positions():
    from types import SimpleNamespace

    from zoo.runtime.decode import CACHE_BUCKET, cache_length

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4 * CACHE_BUCKET + 10))
    assert [cache_length(model, n) for n in (1, CACHE_BUCKET, CACHE_BUCKET + 1, 4 * CACHE_BUCKET + 3)] == \
        [CACHE_BUCKET, CACHE_BUCKET, 2 * CACHE_BUCKET, 4 * CACHE_BUCKET + 10]
    assert cache_length(SimpleNamespace(config=SimpleNamespace()), 5) == CACHE_BUCKET  # no limit known


def test_a_step_that_cannot_be_exported_falls_back_to_the_jit_step(monkeypatch):
    from zoo.runtime.decode import greedy as lean

    from zoo.runtime.decode import ahead_of_time_step, cache_length

    model = zoo.convert(tiny_native("qwen3_moe"))
    length = cache_length(model, IDS.shape[1] + 12)
    exports = []

    def refuse(*args, **kwargs):
        exports.append(1)
        raise RuntimeError("data-dependent branch")

    monkeypatch.setattr(torch.export, "export", refuse)
    with pytest.warns(UserWarning, match="not compiled ahead of time .*data-dependent branch"):
        compiled = lean(model, IDS, 12, backend="inductor")
    assert torch.equal(compiled, lean(model, IDS, 12, compile=False))
    # the refusal is kept for these weights: later calls do not export again (each try costs seconds on a real
    # model, every greedy call), and say the same reason; new weights are tried anew
    with pytest.warns(UserWarning, match="not compiled ahead of time .*data-dependent branch"):
        lean(model, IDS, 12, backend="inductor")
        assert ahead_of_time_step(model, 1, length) is None
    assert len(exports) == 1
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.warns(UserWarning, match="not compiled ahead of time"):
        assert ahead_of_time_step(model, 1, length) is None
    assert len(exports) == 2


@torch.no_grad()
def test_2_3bit_experts_decode_ahead_of_time_on_stored_codes_and_working_copies(monkeypatch):
    """Experts of 2 and 3 bits in one layer, 8-bit inputs on the avx2 set (kernels.STORED_CODES: 2-bit read as stored,
    3-bit on int4 working copies kept outside the module's state; elsewhere every width on copies): the copies are
    registered as buffers while the step is exported (``working_copies``), so it compiles ahead of time, reads them as
    it reads the weights, builds none for stored codes, and decodes the eager tokens; copies rebuilt (a state dict
    loaded) change the step's key, so it is rebuilt. A tensor outside the state that a module does not list is
    refused before compiling (AOTInductor renames such tensors: a KeyError came after compiling); the JIT step
    serves."""
    from zoo.moe import kernels
    from zoo.moe.quantized import PackedStacks, QuantizedExperts
    from zoo.runtime import decode
    from zoo.runtime.decode_aot import _weights_key

    def mixed():
        model = zoo.convert(tiny_native("qwen3_moe")).eval()
        for layer in model.model.layers:
            e = layer.mlp.experts
            layer.mlp.experts = QuantizedExperts.from_dense(e, [2, 3] * (e.num_experts // 2), group_size=32)
        return model

    stored = kernels.load() and kernels.ISAS.index(kernels.best_isa()) >= kernels.ISAS.index("avx2")
    before = kernels.isa() if kernels.load() else None
    if stored:
        kernels.isa("avx2")
        kernels.int8_inputs(True)
    try:
        model = mixed()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="decode step not compiled ahead of time")
            tokens = decode.greedy(model, IDS, 6)
            assert decode.ahead_of_time_step(model, 1, decode.cache_length(model, IDS.shape[1] + 6)) is not None
        packed = [m for m in model.modules() if isinstance(m, PackedStacks)]
        assert packed and all(set(m._kernel_cache) == {(p, b) for p in ("gate_up", "down") for b in (2, 3)[stored:]}
                              for m in packed)
        assert not any(m.working_copies().keys() & dict(m.named_buffers()).keys() for m in packed)  # only exported
        assert torch.equal(tokens, decode.greedy(model, IDS, 6, compile=False))
        key = _weights_key(model)
        model.load_state_dict(model.state_dict())
        model(IDS)
        assert _weights_key(model) != key
    finally:
        if stored:
            kernels.int8_inputs(False)
            kernels.isa(before)

    monkeypatch.setattr(PackedStacks, "working_copies", lambda self: {})
    model = mixed()
    with pytest.warns(UserWarning, match="not compiled ahead of time .*not the model's parameters or buffers"):
        assert decode.ahead_of_time_step(model, 1, 64) is None
