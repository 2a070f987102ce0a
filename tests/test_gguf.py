"""GGUF export: read back with gguf's own reader and dequantised with its own block decoders, the file holds the
zoo's weights (float exactly; quantized experts up to the fp16 rounding of their scales, which the report bounds);
a forward pass written from llama.cpp's conventions (pairwise rotary embedding, softmax top-k renormalised), fed
only from the file, gives the zoo model's logits; what llama.cpp cannot run is refused before a file appears."""
import copy
import math

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.io.gguf_export import NotGGUFExportable, export_gguf




@pytest.fixture(scope="module")
def base():
    return zoo.load("zoo-tiny-moe", dtype=torch.float32).eval()


def read(path):
    """{name: float tensor in numpy order} and {key: value} of a GGUF file, through gguf's reader."""
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        tensors[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).float() \
            .reshape(shape)
    fields = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            continue
        fields[key] = f.parts[f.data[0]].tolist()[0] if f.data else None
    return tensors, fields, reader


def rope_pairs(x, positions, base_freq):
    """llama.cpp's NORM rotary embedding: dimensions (2i, 2i+1) rotate together by position * base^(-2i/d)."""
    d = x.shape[-1]
    theta = positions[:, None].float() * base_freq ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = theta.cos(), theta.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def rope_halves(x, positions, base_freq):
    """llama.cpp's NEOX rotary embedding (qwen3moe): dimension i rotates with i + d/2."""
    d = x.shape[-1]
    theta = positions[:, None].float() * base_freq ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = theta.cos(), theta.sin()
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def gguf_forward(path, ids):
    """Logits of a llama or qwen3moe GGUF (with or without experts) for one sequence, from the file alone."""
    W, F, _ = read(path)
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    rope = rope_pairs if arch == "llama" else rope_halves
    heads, kv = F[f"{arch}.attention.head_count"], F[f"{arch}.attention.head_count_kv"]
    eps, base_freq = F[f"{arch}.attention.layer_norm_rms_epsilon"], F[f"{arch}.rope.freq_base"]
    used = F.get(f"{arch}.expert_used_count")

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    x = W["token_embd.weight"][ids]
    T = len(ids)
    pos = torch.arange(T)
    for i in range(F[f"{arch}.block_count"]):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).view(T, heads, -1)
        k = (h @ W[p + "attn_k.weight"].T).view(T, kv, -1)
        v = (h @ W[p + "attn_v.weight"].T).view(T, kv, -1)
        if p + "attn_q_norm.weight" in W:  # qwen3: RMSNorm of each head's query and key before the rotation
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q.transpose(0, 1), pos, base_freq), rope(k.transpose(0, 1), pos, base_freq)
        k, v = k.repeat_interleave(heads // kv, 0), v.transpose(0, 1).repeat_interleave(heads // kv, 0)
        att = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(0, 1).reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        if used:
            probs = (h @ W[p + "ffn_gate_inp.weight"].T).softmax(-1)
            top, idx = probs.topk(used, -1)
            top = top / top.sum(-1, keepdim=True)
            out = torch.zeros_like(h)
            for t in range(T):
                for w, e in zip(top[t], idx[t]):
                    g = W[p + "ffn_gate_exps.weight"][e] @ h[t]
                    u = W[p + "ffn_up_exps.weight"][e] @ h[t]
                    out[t] += w * (W[p + "ffn_down_exps.weight"][e] @ (torch.nn.functional.silu(g) * u))
        else:
            out = (torch.nn.functional.silu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) \
                @ W[p + "ffn_down.weight"].T
        x = x + out
    x = norm(x, W["output_norm.weight"])
    return x @ W.get("output.weight", W["token_embd.weight"]).T


IDS = torch.tensor([5, 17, 300, 42, 7, 1000, 9, 64, 23, 2])


def test_float_export_holds_the_weights_and_computes_the_models_logits(base, tmp_path):
    report = export_gguf(base, tmp_path / "m.gguf", progress=False)
    assert report.types == {"F32": 42} and report.max_abs_change == 0
    tensors, fields, reader = read(tmp_path / "m.gguf")
    assert fields["llama.expert_count"] == 8 and fields["llama.expert_used_count"] == 2
    assert torch.equal(tensors["blk.1.ffn_down_exps.weight"], base.model.layers[1].mlp.experts.down_proj)
    gate_up = base.model.layers[2].mlp.experts.gate_up_proj
    assert torch.equal(torch.cat([tensors["blk.2.ffn_gate_exps.weight"], tensors["blk.2.ffn_up_exps.weight"]], 1),
                       gate_up)
    with torch.no_grad():
        want = base(IDS[None]).logits[0]
    torch.testing.assert_close(gguf_forward(tmp_path / "m.gguf", IDS), want, atol=2e-4, rtol=1e-4)
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data[:300]]
    tok = zoo.load_tokenizer("zoo-tiny-moe")
    assert tokens == tok.convert_ids_to_tokens(list(range(300)))  # the tokenizer travels, ids unchanged
    # llama.cpp refuses a file whose pre-tokenizer name it does not know ("gpt2" was refused; it says "gpt-2")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"


def test_llama_cpp_runs_the_file_and_generates_the_zoos_tokens(base, tmp_path):
    """Where llama-cpp-python is installed (it builds from source, so not in CI): llama.cpp itself loads the file,
    its logits match the zoo's and 24 greedy tokens are the same."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds from source)")
    export_gguf(base, tmp_path / "m.gguf", progress=False)
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    ids = IDS.tolist()
    llm.eval(ids)
    with torch.no_grad():
        want = base(IDS[None]).logits[0]
    torch.testing.assert_close(torch.tensor(np.array(llm.scores[:len(ids)])), want, atol=5e-3, rtol=1e-3)
    tokens, seq = list(ids), IDS[None]
    for _ in range(24):
        llm.reset()
        llm.eval(tokens)
        tokens.append(int(np.argmax(llm.scores[len(tokens) - 1])))
        with torch.no_grad():
            seq = torch.cat([seq, base(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert tokens == seq[0].tolist()


def test_qwen3_moe_exports_as_qwen3moe(tmp_path):
    from zoo.testing import tiny_model

    model = tiny_model("qwen3_moe").float().eval()
    export_gguf(model, tmp_path / "q.gguf", progress=False)
    tensors, fields, _ = read(tmp_path / "q.gguf")
    assert "blk.0.attn_q_norm.weight" in tensors and fields["qwen3moe.expert_count"] == model.config.num_experts
    ids = IDS % model.config.vocab_size
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(gguf_forward(tmp_path / "q.gguf", ids), want, atol=2e-4, rtol=1e-4)


def test_bf16_checkpoint_folder_streams_to_the_same_file_as_the_model(tmp_path):
    from zoo.components.registry import get_model

    folder = get_model("zoo-tiny-moe").local_path
    report = export_gguf(folder, tmp_path / "f.gguf", progress=False)
    assert set(report.types) == {"BF16", "F32"}  # bf16 weights stay bf16; norms and routers F32
    model = zoo.load("zoo-tiny-moe").eval()  # bf16 as stored
    export_gguf(model, tmp_path / "m.gguf", progress=False)
    a, _, _ = read(tmp_path / "f.gguf")
    b, _, _ = read(tmp_path / "m.gguf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bits, kind", [(8, "Q8_0"), (4, "Q4_1"), (3, "Q4_1")])  # 2 bits: 3 bits' path
def test_quantized_experts_keep_their_codes(base, tmp_path, bits, kind):
    quantized = zoo.apply(copy.deepcopy(base), "quantize", bits=bits)
    report = export_gguf(quantized, tmp_path / "q.gguf", progress=False)
    assert report.types[kind] == 3 * 4  # gate, up and down of every layer
    tensors, _, _ = read(tmp_path / "q.gguf")
    worst = 0.0
    for i, layer in enumerate(quantized.model.layers):
        experts = layer.mlp.experts
        ref = [torch.stack(t) for t in zip(*(experts.dequantized(e) for e in range(8)))]
        inter = ref[0].shape[1] // 2
        got = [torch.cat([tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]], 1),
               tensors[f"blk.{i}.ffn_down_exps.weight"]]
        for g, r in zip(got, ref):
            worst = max(worst, float((g - r).abs().max()))
        assert inter == experts.intermediate_size
    # the only change is the fp16 rounding of the scales, which the report measured the same way
    assert worst == pytest.approx(report.max_abs_change, rel=1e-6, abs=1e-12)
    assert report.max_rel_change < 2e-3
    with torch.no_grad():
        want = quantized(IDS[None]).logits[0]
    got = gguf_forward(tmp_path / "q.gguf", IDS)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("bits, kind", [(8, "Q8_0"), (4, "Q4_1")])
def test_quantized_attention_keeps_its_codes(tmp_path, bits, kind):
    """quantize(targets="all") on a Mixtral with its own LM head: attention projections and the output go to the
    file in their codes (query/key rows reordered for llama.cpp's rotation, scales with them)."""
    from tiny import tiny_native

    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "quantize", bits=bits, group_size=32, targets="all")
    report = export_gguf(model, tmp_path / "q.gguf", progress=False)
    assert report.types[kind] == 3 * 2 + 4 * 2 + 1  # experts, attention, output
    tensors, _, _ = read(tmp_path / "q.gguf")
    attn = model.model.layers[1].self_attn
    for name, proj in (("attn_v", attn.v_proj), ("attn_output", attn.o_proj), ("attn_k", attn.k_proj),
                       ("output", model.lm_head)):
        want = proj.dequantized()
        if name == "attn_k":
            from zoo.io.gguf_export import permute_rope
            want = permute_rope(want, model.config.num_key_value_heads)
        got = tensors["output.weight" if name == "output" else f"blk.1.{name}.weight"]
        assert (got - want).abs().max() <= report.max_abs_change + 1e-7
    assert report.max_rel_change < 2e-3
    with torch.no_grad():
        want = model(IDS[None] % 128).logits[0]
    got = gguf_forward(tmp_path / "q.gguf", IDS % 128)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_what_llama_cpp_cannot_run_is_refused_and_no_file_is_left(base, tmp_path):
    cases = {
        "top-p": lambda m: zoo.apply(m, "top-p", p=0.5),
        "mixed widths": lambda m: zoo.apply(m, "quantize", bits=6, allocation="random"),
        "expert map": lambda m: zoo.apply(m, "hc-smoe", num_experts=6,
                                          calibration=zoo.editing.calibration.corpus("mixed", tokens=256)),
    }
    for label, make in cases.items():
        model = make(copy.deepcopy(base))
        with pytest.raises(NotGGUFExportable):
            export_gguf(model, tmp_path / "x.gguf", progress=False)
        assert list(tmp_path.iterdir()) == [], label
    from zoo.testing import tiny_model

    with pytest.raises(NotGGUFExportable, match="GGUF export covers"):
        export_gguf(tiny_model("olmoe"), tmp_path / "x.gguf", progress=False)


def test_pruned_model_exports_with_its_expert_count(base, tmp_path):
    pruned = zoo.apply(copy.deepcopy(base), "prune-frequency", num_experts=6,
                       calibration=zoo.editing.calibration.corpus("mixed", tokens=256))
    export_gguf(pruned, tmp_path / "p.gguf", progress=False)
    _, fields, _ = read(tmp_path / "p.gguf")
    assert fields["llama.expert_count"] == 6
    with torch.no_grad():
        want = pruned(IDS[None]).logits[0]
    torch.testing.assert_close(gguf_forward(tmp_path / "p.gguf", IDS), want, atol=2e-4, rtol=1e-4)


def test_cli_export_format_gguf(tmp_path):
    from zoo.cli import cli

    out = tmp_path / "model.gguf"
    result = CliRunner().invoke(cli, ["export", "zoo-tiny-moe", str(out), "--format", "gguf"])
    assert result.exit_code == 0, result.output
    assert out.is_file() and gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
