"""GGUF export of Qwen2-MoE (qwen2moe), OLMoE (olmoe), DeepSeek-V3 and -V2 (deepseek2), Granite-MoE(-Shared)
(granitemoe), ERNIE-4.5-MoE (ernie4_5-moe), Hunyuan-MoE (hunyuan-moe), dots.llm1 (dots1) and GLM-4.5 (glm4moe), read
back with gguf's own reader: every tensor is one llama.cpp's loader creates for that architecture, with the shape it
checks, and none is missing or left over; the metadata holds the zoo model's routing under the keys llama.cpp reads;
and a forward pass written from llama.cpp's graph for the architecture (its rotary mode, gating, shared experts,
scales, latent attention in the absorbed form), fed only from the file, gives the zoo model's logits. Where
llama-cpp-python is installed, llama.cpp itself runs each file. Layers of different expert counts are padded to one
where llama.cpp's graph keeps that exact (sigmoid scores with the selection bias: DeepSeek-V3, dots1). What llama.cpp's
architectures cannot run is refused before a file appears."""
import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tiny
import zoo
from zoo.io.gguf_export import EXPERT_ROWS, NotGGUFExportable, export_gguf, gguf_arch
from zoo.moe.layout import decoder_layers, moe_layers, put_block, sync_layout
from zoo.moe.surgery import keep_experts

IDS = torch.tensor([5, 17, 100, 42, 7, 120, 9, 64, 23, 3, 77, 31])


def native(family: str, **changes):
    """``tiny.tiny_native(family)`` with config attributes changed (weights spread the same way)."""
    config = tiny.tiny_config(family)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "tiny_config", lambda _: config)
        return tiny.tiny_native(family)


def read(path):
    """({name: float tensor in numpy order}, {key: scalar value}, {name: ggml shape ne}, architecture) of a file."""
    reader = gguf.GGUFReader(path)
    tensors, shapes = {}, {}
    for t in reader.tensors:
        shapes[t.name] = tuple(int(x) for x in t.shape)
        tensors[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).float() \
            .reshape(tuple(reversed(shapes[t.name])))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    return tensors, fields, shapes, fields["general.architecture"]


def key(arch: str, k) -> str:
    return k.format(arch=arch)


# ------------------------------------------------------------------------------------------ llama.cpp's loader

# loaders (here) that fall back to token_embd where output.weight is missing
TIED_FALLBACK = ("granitemoe", "ernie4_5-moe", "hunyuan-moe", "glm4moe")


def loader_tensors(F_, arch: str, n_vocab: int, present=()) -> dict:
    """{name: ne} of every tensor llama.cpp's loader of ``arch`` creates (and requires: it also refuses a file with
    tensors it did not create), from the file's hyperparameters, as its load_tensors code lists them; the optional
    ones it creates where the file has them (``present``: the file's tensor names) count where present."""
    L = gguf.Keys.LLM
    A = gguf.Keys.Attention
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    n_embd, n_head = g(L.EMBEDDING_LENGTH), g(A.HEAD_COUNT)
    n_expert, n_ff, n_ff_exp = g(L.EXPERT_COUNT), g(L.FEED_FORWARD_LENGTH), g(L.EXPERT_FEED_FORWARD_LENGTH)
    out = {"output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab), "token_embd.weight": (n_embd, n_vocab)}
    if arch in TIED_FALLBACK and "output.weight" not in present:
        del out["output.weight"]  # the loader reads token_embd in its place
    q, kv = (g(A.KEY_LENGTH) * n for n in (n_head, g(A.HEAD_COUNT_KV)))  # (not deepseek2's)
    for i in range(g(L.BLOCK_COUNT)):
        b = f"blk.{i}."
        layer = {"attn_norm.weight": (n_embd,), "ffn_norm.weight": (n_embd,)}
        if arch == "glm4moe":  # its norm before the MLP is named post_attention_norm; attention biases, q/k norms
            del layer["ffn_norm.weight"]
            layer["post_attention_norm.weight"] = (n_embd,)
            layer.update({k: v for k, v in {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                                            "attn_q_norm.weight": (g(A.KEY_LENGTH),),
                                            "attn_k_norm.weight": (g(A.KEY_LENGTH),)}.items() if b + k in present})
        layer.update(mla_tensors(g) if arch == "deepseek2" else gqa_tensors(g))
        if arch in ("hunyuan-moe", "dots1"):  # query/key norms per head
            layer.update({"attn_q_norm.weight": (g(A.KEY_LENGTH),), "attn_k_norm.weight": (g(A.KEY_LENGTH),)})
        if i < (g(L.LEADING_DENSE_BLOCK_COUNT) or 0):
            layer.update({"ffn_gate.weight": (n_embd, n_ff), "ffn_up.weight": (n_embd, n_ff),
                          "ffn_down.weight": (n_ff, n_embd)})
            out.update({b + k: v for k, v in layer.items()})
            continue
        optional, width, n_sh = {}, n_ff_exp, g(L.EXPERT_SHARED_FEED_FORWARD_LENGTH) or 0
        if arch in ("deepseek2", "glm4moe"):  # the selection bias: glm4moe requires it, deepseek2 takes it
            n_sh = n_ff_exp * g(L.EXPERT_SHARED_COUNT)
            (layer if arch == "glm4moe" else optional)["exp_probs_b.bias"] = (n_expert,)
        if arch == "dots1":  # shared experts as deepseek2's; the selection bias optional
            n_sh = n_ff_exp * g(L.EXPERT_SHARED_COUNT)
            optional = {"exp_probs_b.bias": (n_expert,)}
        if arch == "qwen2moe":
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                          "ffn_gate_inp_shexp.weight": (n_embd,)})
        if arch == "olmoe":
            layer.update({"attn_q_norm.weight": (n_embd,), "attn_k_norm.weight": (n_embd,)})
            width = n_ff  # olmoe sizes its experts by feed_forward_length
        if arch == "ernie4_5-moe":
            optional = {"exp_probs_b.bias": (n_expert,)}
        if arch == "hunyuan-moe":  # experts sized by feed_forward_length; a shared expert always
            width, n_sh = n_ff, n_sh or n_ff
        if arch == "granitemoe":
            width = n_ff  # so does granitemoe
            optional = {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.bias": (n_embd,)}
        layer.update({k: v for k, v in optional.items() if b + k in present})
        layer.update({"ffn_gate_inp.weight": (n_embd, n_expert), "ffn_gate_exps.weight": (n_embd, width, n_expert),
                      "ffn_up_exps.weight": (n_embd, width, n_expert),
                      "ffn_down_exps.weight": (width, n_embd, n_expert)})
        if n_sh:  # (granitemoe, ernie4_5-moe: where the file says it has one)
            layer.update({"ffn_gate_shexp.weight": (n_embd, n_sh), "ffn_up_shexp.weight": (n_embd, n_sh),
                          "ffn_down_shexp.weight": (n_sh, n_embd)})
        out.update({b + k: v for k, v in layer.items()})
    return out


def gqa_tensors(g) -> dict:
    A = gguf.Keys.Attention
    n_embd, n_head, n_kv, d = g(gguf.Keys.LLM.EMBEDDING_LENGTH), g(A.HEAD_COUNT), g(A.HEAD_COUNT_KV), g(A.KEY_LENGTH)
    return {"attn_q.weight": (n_embd, d * n_head), "attn_k.weight": (n_embd, d * n_kv),
            "attn_v.weight": (n_embd, d * n_kv), "attn_output.weight": (d * n_head, n_embd)}


def mla_tensors(g) -> dict:
    A = gguf.Keys.Attention
    n_embd, n_head = g(gguf.Keys.LLM.EMBEDDING_LENGTH), g(A.HEAD_COUNT)
    rank, q_rank, rot = g(A.KV_LORA_RANK), g(A.Q_LORA_RANK), g(gguf.Keys.Rope.DIMENSION_COUNT)
    k_mla, v_mla = g(A.KEY_LENGTH_MLA), g(A.VALUE_LENGTH_MLA)
    out = {"attn_kv_a_norm.weight": (rank,), "attn_kv_a_mqa.weight": (n_embd, rank + rot),
           "attn_k_b.weight": (k_mla - rot, rank, n_head), "attn_v_b.weight": (rank, v_mla, n_head),
           "attn_output.weight": (n_head * v_mla, n_embd)}
    if q_rank:
        out.update({"attn_q_a_norm.weight": (q_rank,), "attn_q_a.weight": (n_embd, q_rank),
                    "attn_q_b.weight": (q_rank, n_head * k_mla)})
    else:
        out["attn_q.weight"] = (n_embd, n_head * k_mla)
    return out


def check_file_layout(shapes: dict, fields: dict, arch: str, config) -> None:
    """Every tensor is one gguf's tensor map names for ``arch`` and llama.cpp's loader wants, with its shape."""
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[gguf_arch(arch)]
             for i in range(config.num_hidden_layers)}
    assert {n.rsplit(".", 1)[0] for n in shapes} <= known, sorted({n.rsplit(".", 1)[0] for n in shapes} - known)
    assert all(n.rsplit(".", 1)[1] in ("weight", "bias") for n in shapes)
    want = loader_tensors(fields, arch, config.vocab_size, present=set(shapes))
    assert shapes == want, {n: (shapes.get(n), want.get(n)) for n in set(shapes) | set(want)
                            if shapes.get(n) != want.get(n)}


# ------------------------------------------------------------------------------------------ llama.cpp's graphs

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, base, neox):
    """ggml_rope_ext without scaling on ``x [..., T, d]``: NORM rotates (2i, 2i+1), NEOX rotates (i, i + d/2), both by
    pos * base^(-2i/d)."""
    d = x.shape[-1]
    theta = pos[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = theta.cos(), theta.sin()
    a, b = (x[..., :d // 2], x[..., d // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.cat([ra, rb], -1) if neox else torch.stack([ra, rb], -1).flatten(-2)


def attend(q, k, v, scale):
    """Causal softmax attention: q [H, T, d], k [Hk, T, d], v [Hk, T, dv] (Hk divides H) -> [T, H * dv]."""
    H, T = q.shape[0], q.shape[1]
    k, v = k.repeat_interleave(H // k.shape[0], 0), v.repeat_interleave(H // v.shape[0], 0)
    att = (q @ k.transpose(1, 2)) * scale
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    return (att @ v).transpose(0, 1).reshape(T, -1)


NORM_ROPE = ("granitemoe", "ernie4_5-moe")  # (here) rotating neighbouring pairs; the others NEOX (halves)


def gqa_attention(W, F_, arch, p, h, pos):
    """llama.cpp's qwen2moe / olmoe / granitemoe / ernie4_5-moe / hunyuan-moe / dots1 / glm4moe attention: biases
    added, olmoe's norms over the whole q and k, hunyuan-moe's per head after the rotation, dots1's and glm4moe's
    before it, glm4moe's rotation of part of each head (NEOX over its first rope.dimension_count), granitemoe's
    attention.scale in place of 1/sqrt(head size) and its output bias."""
    A = gguf.Keys.Attention
    heads, kv, eps = F_[key(arch, A.HEAD_COUNT)], F_[key(arch, A.HEAD_COUNT_KV)], F_[key(arch, A.LAYERNORM_RMS_EPS)]
    base = F_[key(arch, gguf.Keys.Rope.FREQ_BASE)]
    q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0) for n in "qkv")
    norms = (W[p + "attn_q_norm.weight"], W[p + "attn_k_norm.weight"]) if p + "attn_q_norm.weight" in W else None
    if norms and arch == "olmoe":  # over the whole projections
        q, k = rms(q, norms[0], eps), rms(k, norms[1], eps)
    T = h.shape[0]
    q, k, v = (t.view(T, n, -1).transpose(0, 1) for t, n in ((q, heads), (k, kv), (v, kv)))
    if norms and arch in ("dots1", "glm4moe"):  # per head, before the rotation
        q, k = rms(q, norms[0], eps), rms(k, norms[1], eps)
    neox, n_rot = arch not in NORM_ROPE, F_[key(arch, gguf.Keys.Rope.DIMENSION_COUNT)]  # glm4moe: part of each head
    q = torch.cat([rope(q[..., :n_rot], pos, base, neox=neox), q[..., n_rot:]], -1)
    k = torch.cat([rope(k[..., :n_rot], pos, base, neox=neox), k[..., n_rot:]], -1)
    if norms and arch == "hunyuan-moe":  # per head, after the rotation
        q, k = rms(q, norms[0], eps), rms(k, norms[1], eps)
    scale = F_.get(key(arch, A.SCALE)) or 1 / math.sqrt(q.shape[-1])
    return attend(q, k, v, scale) @ W[p + "attn_output.weight"].T + W.get(p + "attn_output.bias", 0)


def mla_attention(W, F_, p, h, pos):
    """llama.cpp's deepseek2 attention in the absorbed MLA form: queries absorb attn_k_b into the latent, one key
    head (latent + rotary key, NORM rotation) and one value head (the latent) are shared by all heads, attn_v_b
    decompresses each head's output."""
    A = gguf.Keys.Attention
    g = lambda k: F_[key("deepseek2", k)]  # noqa: E731
    heads, eps, base, rot = g(A.HEAD_COUNT), g(A.LAYERNORM_RMS_EPS), g(gguf.Keys.Rope.FREQ_BASE), \
        g(gguf.Keys.Rope.DIMENSION_COUNT)
    rank, k_mla = g(A.KV_LORA_RANK), g(A.KEY_LENGTH_MLA)
    T = h.shape[0]
    if p + "attn_q_a.weight" in W:
        q = rms(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"], eps) @ W[p + "attn_q_b.weight"].T
    else:
        q = h @ W[p + "attn_q.weight"].T
    q = q.view(T, heads, k_mla).transpose(0, 1)
    q_nope, q_pe = q[..., :k_mla - rot], rope(q[..., k_mla - rot:], pos, base, neox=False)
    kv = h @ W[p + "attn_kv_a_mqa.weight"].T
    latent, k_pe = rms(kv[:, :rank], W[p + "attn_kv_a_norm.weight"], eps), rope(kv[None, :, rank:], pos, base, False)
    q_abs = torch.einsum("hrn,htn->htr", W[p + "attn_k_b.weight"], q_nope)
    out = attend(torch.cat([q_abs, q_pe], -1), torch.cat([latent[None], k_pe], -1), latent[None],
                 1 / math.sqrt(k_mla)).view(T, heads, rank)
    out = torch.einsum("hvr,thr->thv", W[p + "attn_v_b.weight"], out).reshape(T, -1)
    return out @ W[p + "attn_output.weight"].T


def swiglu(h, gate, up, down):
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


# architectures that renormalise whatever the file says (their build_moe_ffn call's norm_w)
NORM_W = {"granitemoe": True, "ernie4_5-moe": True, "hunyuan-moe": True}


def moe_ffn(W, F_, arch, p, h):
    """llama.cpp's build_moe_ffn for the architecture's gating, plus its shared expert."""
    L = gguf.Keys.LLM
    used, logits = F_[key(arch, L.EXPERT_USED_COUNT)], h @ W[p + "ffn_gate_inp.weight"].T
    sigmoid = F_.get(key(arch, L.EXPERT_GATING_FUNC)) == gguf.ExpertGatingFuncType.SIGMOID  # else softmax
    probs = select = logits.sigmoid() if sigmoid else logits.softmax(-1)
    if p + "exp_probs_b.bias" in W:  # the selection bias, on the scores
        select = probs + W[p + "exp_probs_b.bias"]
    groups, kept = F_.get(key(arch, L.EXPERT_GROUP_COUNT), 0), F_.get(key(arch, L.EXPERT_GROUP_USED_COUNT), 0)
    if groups > 1:  # groups scored by their two best experts; the experts of the others masked out
        by_group = select.view(len(h), groups, -1)
        best = by_group.topk(2, -1).values.sum(-1).topk(kept, -1).indices
        dropped = torch.ones(len(h), groups, dtype=torch.bool).scatter_(1, best, False)
        select = by_group.masked_fill(dropped[..., None], float("-inf")).view(len(h), -1)
    idx = select.topk(used, -1).indices
    weights = probs.gather(1, idx)
    if NORM_W.get(arch, F_.get(key(arch, L.EXPERT_WEIGHTS_NORM), False)):
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    scale = F_.get(key(arch, L.EXPERT_WEIGHTS_SCALE), 0.0)
    weights = weights * (scale if scale not in (0.0, 1.0) else 1.0)
    out = torch.zeros_like(h)
    for t in range(len(h)):
        for w, e in zip(weights[t], idx[t]):
            out[t] += w * swiglu(h[t], W[p + "ffn_gate_exps.weight"][e], W[p + "ffn_up_exps.weight"][e],
                                 W[p + "ffn_down_exps.weight"][e])
    if p + "ffn_gate_shexp.weight" in W:
        shared = swiglu(h, W[p + "ffn_gate_shexp.weight"], W[p + "ffn_up_shexp.weight"], W[p + "ffn_down_shexp.weight"])
        if p + "ffn_gate_inp_shexp.weight" in W:  # qwen2moe: scaled by the sigmoid of its gate
            shared = shared * (h @ W[p + "ffn_gate_inp_shexp.weight"])[:, None].sigmoid()
        out = out + shared
    return out


def gguf_forward(path, ids):
    """Logits of a qwen2moe, olmoe or deepseek2 GGUF for one sequence, from the file alone."""
    W, F_, _, arch = read(path)
    eps = F_[key(arch, gguf.Keys.Attention.LAYERNORM_RMS_EPS)]
    dense = F_.get(key(arch, gguf.Keys.LLM.LEADING_DENSE_BLOCK_COUNT), 0)
    L = gguf.Keys.LLM
    residual = F_.get(key(arch, L.RESIDUAL_SCALE)) or 1.0  # granitemoe's scales (0 or absent: none)
    x, pos = W["token_embd.weight"][ids] * (F_.get(key(arch, L.EMBEDDING_SCALE)) or 1.0), torch.arange(len(ids))
    for i in range(F_[key(arch, L.BLOCK_COUNT)]):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"], eps)
        x = x + residual * (mla_attention(W, F_, p, h, pos) if arch == "deepseek2"
                            else gqa_attention(W, F_, arch, p, h, pos))
        h = rms(x, W[p + "ffn_norm.weight"] if p + "ffn_norm.weight" in W else W[p + "post_attention_norm.weight"], eps)
        if i < dense:
            x = x + swiglu(h, W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"], W[p + "ffn_down.weight"])
        else:
            x = x + residual * moe_ffn(W, F_, arch, p, h)
    logits = rms(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T
    return logits / (F_.get(key(arch, L.LOGIT_SCALE)) or 1.0)


def check_logits(model, path, ids=IDS):
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    got = gguf_forward(path, ids)
    diff = float((got - want).abs().max())
    print(f"{path.name}: max |logit difference| {diff:.2e} (logits up to {float(want.abs().max()):.2f})")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return diff


# ------------------------------------------------------------------------------------------------ the tests

def test_qwen2_moe_exports_as_qwen2moe_with_its_gated_shared_expert(tmp_path):
    model = zoo.convert(native("qwen2_moe", mlp_only_layers=[])).eval()
    export_gguf(model, tmp_path / "q.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "q.gguf")
    c, L = model.config, gguf.Keys.LLM
    assert arch == "qwen2moe"
    assert (F_[key(arch, L.EXPERT_COUNT)], F_[key(arch, L.EXPERT_USED_COUNT)]) == (c.num_experts,
                                                                                   c.num_experts_per_tok)
    assert F_[key(arch, L.EXPERT_FEED_FORWARD_LENGTH)] == c.moe_intermediate_size
    assert F_[key(arch, L.EXPERT_SHARED_FEED_FORWARD_LENGTH)] == c.shared_expert_intermediate_size
    check_file_layout(shapes, F_, arch, c)
    block = model.model.layers[1].mlp
    assert torch.equal(W["blk.1.ffn_gate_inp_shexp.weight"], block.shared_experts.gate.weight[0])
    assert torch.equal(W["blk.1.attn_k.bias"], model.model.layers[1].self_attn.k_proj.bias)  # NEOX: rows unchanged
    check_logits(model, tmp_path / "q.gguf")


def test_qwen2_moe_without_qkv_biases_gets_the_zero_biases_llama_cpp_requires(tmp_path):
    model = zoo.convert(native("qwen2_moe", mlp_only_layers=[], qkv_bias=False)).eval()
    export_gguf(model, tmp_path / "q.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "q.gguf")
    check_file_layout(shapes, F_, arch, model.config)
    assert not W["blk.0.attn_q.bias"].any()
    check_logits(model, tmp_path / "q.gguf")


def test_olmoe_exports_as_olmoe_with_its_whole_width_qk_norms(tmp_path):
    model = zoo.convert(native("olmoe", num_key_value_heads=4)).eval()
    export_gguf(model, tmp_path / "o.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "o.gguf")
    c, L = model.config, gguf.Keys.LLM
    assert arch == "olmoe"
    assert (F_[key(arch, L.EXPERT_COUNT)], F_[key(arch, L.EXPERT_USED_COUNT)]) == (c.num_experts,
                                                                                   c.num_experts_per_tok)
    assert F_[key(arch, L.FEED_FORWARD_LENGTH)] == c.intermediate_size
    assert key(arch, L.EXPERT_SHARED_COUNT) not in F_ and key(arch, L.EXPERT_WEIGHTS_NORM) not in F_
    check_file_layout(shapes, F_, arch, c)
    assert torch.equal(W["blk.0.attn_q_norm.weight"], model.model.layers[0].self_attn.q_norm.weight)
    check_logits(model, tmp_path / "o.gguf")


def test_tied_embeddings_get_the_output_tensor_olmoe_requires(tmp_path):
    """llama.cpp's olmoe (like qwen2moe and deepseek2) has no tied-embedding fallback: output.weight is written."""
    model = zoo.convert(native("olmoe", num_key_value_heads=4, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    export_gguf(model, tmp_path / "o.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "o.gguf")
    check_file_layout(shapes, F_, arch, model.config)
    assert torch.equal(W["output.weight"], W["token_embd.weight"])
    check_logits(model, tmp_path / "o.gguf")


GRANITE_KEYS = (("embedding_multiplier", gguf.Keys.LLM.EMBEDDING_SCALE),
                ("residual_multiplier", gguf.Keys.LLM.RESIDUAL_SCALE),
                ("attention_multiplier", gguf.Keys.Attention.SCALE), ("logits_scaling", gguf.Keys.LLM.LOGIT_SCALE))


def granite_facts_hold(F_, model):
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key("granitemoe", k))  # noqa: E731
    for name, k in GRANITE_KEYS:
        assert g(k) == pytest.approx(getattr(c, name)), name
    assert (g(L.EXPERT_COUNT), g(L.EXPERT_USED_COUNT)) == (c.num_local_experts, c.num_experts_per_tok)
    assert g(L.FEED_FORWARD_LENGTH) == c.intermediate_size  # granitemoe sizes its experts by it
    assert g(L.EXPERT_SHARED_FEED_FORWARD_LENGTH) == (getattr(c, "shared_intermediate_size", 0) or None)


def test_granitemoe_exports_as_granitemoe_with_its_multipliers(tmp_path):
    """Embedding, residual and attention multipliers and the logits' divisor under the keys llama.cpp's granitemoe
    reads; softmax top-k renormalised; query/key rows reordered for its pairwise (NORM) rotation."""
    model = zoo.convert(tiny.tiny_native("granitemoe")).eval()
    export_gguf(model, tmp_path / "g.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "g.gguf")
    assert arch == "granitemoe"
    granite_facts_hold(F_, model)
    check_file_layout(shapes, F_, arch, model.config)
    assert not any("shexp" in n for n in shapes)
    check_logits(model, tmp_path / "g.gguf")


def test_granitemoeshared_exports_its_shared_mlp_as_the_shared_expert(tmp_path):
    """The decoder layer's shared MLP (one [gate; up] projection) as ffn_gate/up/down_shexp; attention biases (q/k
    rows reordered like the weights) and tied embeddings (no output.weight: the loader falls back)."""
    model = zoo.convert(native("granitemoeshared", attention_bias=True, tie_word_embeddings=True)).eval()
    export_gguf(model, tmp_path / "g.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "g.gguf")
    assert arch == "granitemoe"
    granite_facts_hold(F_, model)
    check_file_layout(shapes, F_, arch, model.config)
    assert "output.weight" not in shapes and "blk.0.attn_output.bias" in shapes
    shared = model.model.layers[1].shared_mlp
    assert torch.equal(W["blk.1.ffn_down_shexp.weight"], shared.output_linear.weight)
    gate_up = shared.input_linear.weight
    assert torch.equal(W["blk.1.ffn_up_shexp.weight"], gate_up[gate_up.shape[0] // 2:])
    check_logits(model, tmp_path / "g.gguf")


def test_quantized_granite_shared_mlp_splits_its_codes_into_gate_and_up(tmp_path):
    """quantize(targets="all") quantizes the fused [gate; up] projection of the shared MLP: its rows (codes, with
    their per-row scales) go to ffn_gate_shexp and ffn_up_shexp as Q8_0 blocks."""
    model = zoo.convert(native("granitemoeshared", intermediate_size=64, shared_intermediate_size=64)).eval()
    model = zoo.apply(model, "quantize", bits=8, targets="all")
    report = export_gguf(model, tmp_path / "g.gguf", progress=False)
    _, F_, shapes, arch = read(tmp_path / "g.gguf")
    assert report.types["Q8_0"] == 10 * model.config.num_hidden_layers + 1  # 4 attention, 3 experts, 3 shared; head
    check_file_layout(shapes, F_, arch, model.config)
    with torch.no_grad():
        want = model(IDS[None]).logits[0]
    assert (gguf_forward(tmp_path / "g.gguf", IDS) - want).abs().max() < 0.01 * want.abs().max()


def test_ernie4_5_moe_exports_with_its_selection_bias_shared_expert_and_dense_lead(tmp_path):
    """Softmax scores, the selection bias (moe_statics) on them, renormalised; a plain shared expert; the leading
    dense layer (moe_layer_start_index) as leading_dense_block_count with every later layer MoE (step 1)."""
    model = zoo.convert(tiny.tiny_native("ernie4_5_moe")).eval()
    export_gguf(model, tmp_path / "e.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "e.gguf")
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    assert arch == "ernie4_5-moe"
    assert (g(L.EXPERT_COUNT), g(L.EXPERT_USED_COUNT)) == (c.moe_num_experts, c.moe_k)
    assert (g(L.LEADING_DENSE_BLOCK_COUNT), g(L.INTERLEAVE_MOE_LAYER_STEP)) == (c.moe_layer_start_index, 1)
    assert (g(L.FEED_FORWARD_LENGTH), g(L.EXPERT_FEED_FORWARD_LENGTH)) == (c.intermediate_size,
                                                                          c.moe_intermediate_size)
    assert g(L.EXPERT_SHARED_FEED_FORWARD_LENGTH) == c.moe_intermediate_size * c.moe_num_shared_experts
    check_file_layout(shapes, F_, arch, c)
    assert torch.equal(W["blk.2.exp_probs_b.bias"], model.model.layers[2].mlp.router.e_score_correction_bias)
    assert torch.equal(W["blk.0.attn_q.weight"], model.model.layers[0].self_attn.q_proj.weight)  # NORM: as it is
    check_logits(model, tmp_path / "e.gguf")


def test_ernie4_5_moe_without_shared_experts_and_with_tied_embeddings(tmp_path):
    model = zoo.convert(native("ernie4_5_moe", moe_num_shared_experts=0, tie_word_embeddings=True)).eval()
    export_gguf(model, tmp_path / "e.gguf", progress=False)
    _, F_, shapes, arch = read(tmp_path / "e.gguf")
    assert key(arch, gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) not in F_ and "output.weight" not in shapes
    check_file_layout(shapes, F_, arch, model.config)
    check_logits(model, tmp_path / "e.gguf")


def test_hunyuan_v1_moe_exports_with_its_shared_mlp_and_per_head_qk_norms(tmp_path):
    """Softmax top-k renormalised plus the shared MLP (always there); query/key norms per head after the rotation;
    experts sized by feed_forward_length."""
    model = zoo.convert(tiny.tiny_native("hunyuan_v1_moe")).eval()
    export_gguf(model, tmp_path / "h.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "h.gguf")
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    assert arch == "hunyuan-moe"
    assert (g(L.EXPERT_COUNT), g(L.EXPERT_USED_COUNT)) == (c.num_experts, c.moe_topk)
    assert g(L.FEED_FORWARD_LENGTH) == g(L.EXPERT_SHARED_FEED_FORWARD_LENGTH) == c.intermediate_size
    check_file_layout(shapes, F_, arch, c)
    assert torch.equal(W["blk.1.attn_k_norm.weight"], model.model.layers[1].self_attn.key_layernorm.weight)
    check_logits(model, tmp_path / "h.gguf")


def test_dots1_exports_with_its_grouped_sigmoid_routing(tmp_path):
    """Sigmoid scores with the selection bias, 2 of 4 groups, renormalised and scaled (routed_scaling_factor 2), a
    shared expert, one leading dense layer; per-head query/key norms before the rotation."""
    model = zoo.convert(tiny.tiny_native("dots1")).eval()
    export_gguf(model, tmp_path / "d.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "d.gguf")
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    assert arch == "dots1"
    assert (g(L.EXPERT_COUNT), g(L.EXPERT_USED_COUNT)) == (c.n_routed_experts, c.num_experts_per_tok)
    assert (g(L.LEADING_DENSE_BLOCK_COUNT), g(L.EXPERT_SHARED_COUNT)) == (c.first_k_dense_replace, c.n_shared_experts)
    assert g(L.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
    assert (g(L.EXPERT_WEIGHTS_NORM), g(L.EXPERT_WEIGHTS_SCALE)) == (True, pytest.approx(c.routed_scaling_factor))
    assert (g(L.EXPERT_GROUP_COUNT), g(L.EXPERT_GROUP_USED_COUNT)) == (c.n_group, c.topk_group)
    check_file_layout(shapes, F_, arch, c)
    assert torch.equal(W["blk.1.exp_probs_b.bias"], model.model.layers[1].mlp.router.e_score_correction_bias)
    check_logits(model, tmp_path / "d.gguf")


def test_glm4_moe_exports_with_partial_rotation_biases_and_qk_norms(tmp_path):
    """Sigmoid + selection bias, 2 of 4 groups, renormalised, scaled by 1.5, a shared expert and a leading dense layer;
    the rotation on half of each head (partial_rotary_factor 0.5), q/k/v biases, per-head query/key norms."""
    model = zoo.convert(tiny.tiny_native("glm4_moe")).eval()
    export_gguf(model, tmp_path / "g.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "g.gguf")
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    assert arch == "glm4moe"
    assert g(gguf.Keys.Rope.DIMENSION_COUNT) == g(gguf.Keys.Attention.KEY_LENGTH) // 2
    assert (g(L.LEADING_DENSE_BLOCK_COUNT), g(L.EXPERT_SHARED_COUNT)) == (c.first_k_dense_replace, c.n_shared_experts)
    assert g(L.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
    assert (g(L.EXPERT_WEIGHTS_NORM), g(L.EXPERT_WEIGHTS_SCALE)) == (True, pytest.approx(c.routed_scaling_factor))
    assert (g(L.EXPERT_GROUP_COUNT), g(L.EXPERT_GROUP_USED_COUNT)) == (c.n_group, c.topk_group)
    check_file_layout(shapes, F_, arch, c)
    assert "blk.0.attn_q_norm.weight" in shapes and "blk.0.attn_q.bias" in shapes
    check_logits(model, tmp_path / "g.gguf")


def deepseek_facts_hold(F_, model):
    c, L, A = model.config, gguf.Keys.LLM, gguf.Keys.Attention
    router = model.model.layers[c.first_k_dense_replace].mlp.router
    g = lambda k: F_[key("deepseek2", k)]  # noqa: E731
    assert (g(L.EXPERT_COUNT), g(L.EXPERT_USED_COUNT)) == (c.n_routed_experts, c.num_experts_per_tok)
    assert g(L.LEADING_DENSE_BLOCK_COUNT) == c.first_k_dense_replace
    assert g(L.EXPERT_SHARED_COUNT) == c.n_shared_experts
    assert g(L.EXPERT_FEED_FORWARD_LENGTH) == c.moe_intermediate_size
    assert g(L.FEED_FORWARD_LENGTH) == c.intermediate_size
    assert g(L.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
    assert g(L.EXPERT_WEIGHTS_NORM) is router.norm_topk_prob
    assert g(L.EXPERT_WEIGHTS_SCALE) == pytest.approx(router.routed_scaling_factor)
    assert (g(L.EXPERT_GROUP_COUNT), g(L.EXPERT_GROUP_USED_COUNT)) == (router.n_group, router.topk_group)
    assert g(A.HEAD_COUNT_KV) == 1  # absorbed MLA: one latent key/value head
    assert (g(A.KV_LORA_RANK), g(A.Q_LORA_RANK)) == (c.kv_lora_rank, c.q_lora_rank or 0)
    assert (g(A.KEY_LENGTH), g(A.VALUE_LENGTH)) == (c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank)
    assert (g(A.KEY_LENGTH_MLA), g(A.VALUE_LENGTH_MLA)) == (c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    assert g(gguf.Keys.Rope.DIMENSION_COUNT) == c.qk_rope_head_dim


def test_deepseek_v3_exports_as_deepseek2(tmp_path):
    """Sigmoid + selection bias, 2 of 4 groups, routed scaling 2.5, a shared expert, one leading dense layer."""
    model = zoo.convert(tiny.tiny_native("deepseek_v3")).eval()
    export_gguf(model, tmp_path / "d.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "d.gguf")
    assert arch == "deepseek2"
    deepseek_facts_hold(F_, model)
    check_file_layout(shapes, F_, arch, model.config)
    assert torch.equal(W["blk.2.exp_probs_b.bias"], model.model.layers[2].mlp.router.e_score_correction_bias)
    check_logits(model, tmp_path / "d.gguf")


def test_deepseek_v3_without_query_lora_and_with_half_rotation(tmp_path):
    """The plain query projection; rotary rows reordered for llama.cpp's pairwise rotation (rope_interleave=False);
    values narrower than the latent, so a transposed attn_v_b could not pass."""
    model = zoo.convert(native("deepseek_v3", q_lora_rank=None, rope_interleave=False, v_head_dim=12)).eval()
    export_gguf(model, tmp_path / "d.gguf", progress=False)
    _, F_, shapes, arch = read(tmp_path / "d.gguf")
    deepseek_facts_hold(F_, model)
    check_file_layout(shapes, F_, arch, model.config)
    check_logits(model, tmp_path / "d.gguf")


def test_deepseek_v2_exports_as_deepseek2_with_softmax_gating(tmp_path):
    """DeepSeek-V2's greedy routing: softmax scores, no selection bias, not renormalised, scaled by
    routed_scaling_factor; two shared experts, one leading dense layer, latent attention with interleaved rotation."""
    model = zoo.convert(tiny.tiny_native("deepseek_v2")).eval()
    export_gguf(model, tmp_path / "d.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "d.gguf")
    c, L = model.config, gguf.Keys.LLM
    g = lambda k: F_.get(key(arch, k))  # noqa: E731
    assert arch == "deepseek2"
    assert g(L.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SOFTMAX
    assert (g(L.EXPERT_WEIGHTS_NORM), g(L.EXPERT_WEIGHTS_SCALE)) == (False, pytest.approx(c.routed_scaling_factor))
    assert (g(L.LEADING_DENSE_BLOCK_COUNT), g(L.EXPERT_SHARED_COUNT)) == (c.first_k_dense_replace, c.n_shared_experts)
    assert key(arch, L.EXPERT_GROUP_COUNT) not in F_ and not any("exp_probs_b" in n for n in shapes)
    check_file_layout(shapes, F_, arch, c)
    check_logits(model, tmp_path / "d.gguf")


# ------------------------------------------------------------------ layers of different expert counts (padded)

def keep_in_groups(moe, keep):
    """``keep_experts``, the router keeping its expert groups (the zoo's pruning turns them off): each group must
    keep as many experts."""
    cut, old = keep_experts(moe, keep), moe.router
    router = type(old)(old.hidden_size, len(keep), old.top_k, **old.options)
    router.load_state_dict(cut.router.state_dict())
    return cut.with_parts(router, cut.experts)


def pruned(model, keep: dict, cut=keep_experts):
    """The zoo model with layer i's experts cut to ``keep[i]`` (experts, router rows and selection bias sliced), as
    per-layer pruning leaves it."""
    layers = decoder_layers(model)
    for i, moe in moe_layers(model):
        if i in keep:
            put_block(layers[i], cut(moe, keep[i]))
    sync_layout(model)
    return model.eval()


def padding_holds(path, model, report):
    """The file holds every layer at the largest count: each layer's experts at their slots (its groups' first), the
    padded ones with zero router rows and weights and the lowest f32 as their selection bias; the report counts
    them and the bytes they add."""
    W, F_, shapes, arch = read(path)
    reader = gguf.GGUFReader(path)
    counts = {i: moe.num_experts for i, moe in moe_layers(model)}
    count = max(counts.values())
    assert F_[key(arch, gguf.Keys.LLM.EXPERT_COUNT)] == count
    groups = F_.get(key(arch, gguf.Keys.LLM.EXPERT_GROUP_COUNT), 1)
    added = 0
    for i, moe in moe_layers(model):
        own = torch.arange(counts[i])
        slots = own // (counts[i] // groups) * (count // groups) + own % (counts[i] // groups)
        padded = torch.ones(count, dtype=torch.bool).scatter_(0, slots, False)
        assert torch.equal(W[f"blk.{i}.ffn_gate_inp.weight"][slots], moe.router.weight)
        assert torch.equal(W[f"blk.{i}.exp_probs_b.bias"][slots], moe.router.e_score_correction_bias)
        assert (W[f"blk.{i}.exp_probs_b.bias"][padded] == torch.finfo(torch.float32).min).all()
        for part in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert not W[f"blk.{i}.{part}.weight"][padded].any(), (i, part)
        rows = sum(t.n_bytes for t in reader.tensors if t.name.startswith(f"blk.{i}.")
                   and t.name.split(".", 2)[2] in EXPERT_ROWS)
        added += rows // count * (count - counts[i])
    layers = {i: count - c for i, c in counts.items() if c < count}
    assert report.padding == {"num_experts": count, "layers": layers, "bytes": added}
    assert (report.padded_experts, report.padded_bytes) == (sum(layers.values()), added) and added > 0
    check_file_layout(shapes, F_, arch, model.config)


def deepseek_ungrouped(**changes):
    """The tiny DeepSeek-V3 without expert groups, routing each token to 4 experts."""
    return zoo.convert(native("deepseek_v3", n_group=1, topk_group=1, num_experts_per_tok=4, **changes))


def test_deepseek_v3_layers_of_different_counts_export_padded(tmp_path):
    """Layer 1 pruned to 6 of 8 experts: the file holds 8 in every layer, layer 1's last two never chosen (sigmoid
    scores plus the lowest f32 as selection bias; with 4 of 6 picked, a padded expert's score 0.5 alone would often
    win); llama.cpp's graph gives the model's logits. The zoo folder it saves exports the same file."""
    model = pruned(deepseek_ungrouped(), {1: [0, 2, 3, 5, 6, 7]})
    assert [moe.num_experts for _, moe in moe_layers(model)] == [6, 8]
    report = export_gguf(model, tmp_path / "d.gguf", progress=False)
    padding_holds(tmp_path / "d.gguf", model, report)
    print(f"padded {report.padded_experts} experts: {report.padded_bytes} bytes")
    check_logits(model, tmp_path / "d.gguf")
    model.save_pretrained(tmp_path / "m")
    export_gguf(tmp_path / "m", tmp_path / "f.gguf", progress=False)
    assert same_file(tmp_path / "d.gguf", tmp_path / "f.gguf")


def test_deepseek_v3_groups_are_padded_equally(tmp_path):
    """12 experts in 4 groups of 3 (2 groups kept); layer 1 keeps 2 of each group, its router its groups: each group
    is padded with one expert, so llama.cpp's groups of 3 hold the layer's groups of 2, scored by the same two
    best."""
    model = pruned(zoo.convert(native("deepseek_v3", n_routed_experts=12)), {1: [0, 1, 3, 4, 6, 7, 9, 10]},
                   keep_in_groups)
    assert (moe_layers(model)[0][1].router.n_group, moe_layers(model)[0][1].num_experts) == (4, 8)
    report = export_gguf(model, tmp_path / "d.gguf", progress=False)
    assert report.padding["layers"] == {1: 4}
    padding_holds(tmp_path / "d.gguf", model, report)  # layer 1's experts at slots 0, 1, 3, 4, 6, 7, 9, 10
    _, F_, _, _ = read(tmp_path / "d.gguf")
    assert (F_["deepseek2.expert_group_count"], F_["deepseek2.expert_group_used_count"]) == (4, 2)
    check_logits(model, tmp_path / "d.gguf")


def test_quantized_experts_are_padded_with_zero_blocks(tmp_path):
    """Int8 experts: the padded experts are Q8_0 blocks of scale 0 (zero weights)."""
    model = pruned(deepseek_ungrouped(), {1: [1, 2, 4, 5, 7]})
    model = zoo.apply(model, "quantize", bits=8)
    report = export_gguf(model, tmp_path / "q.gguf", progress=False)
    assert report.types["Q8_0"] == 3 * 2 and report.padding["layers"] == {1: 3}
    W, _, _, _ = read(tmp_path / "q.gguf")
    down = W["blk.1.ffn_down_exps.weight"]
    assert not down[5:].any() and down[:5].abs().amax((1, 2)).all()
    q8_0 = 2 * 32 * (64 // 32 * 34) + 64 * (32 // 32 * 34)  # one expert's gate, up ([32, 64]) and down ([64, 32])
    assert report.padded_bytes == 3 * (q8_0 + 64 * 4 + 4)  # the experts, their F32 router rows and biases
    with torch.no_grad():
        want = model(IDS[None]).logits[0]
    assert (gguf_forward(tmp_path / "q.gguf", IDS) - want).abs().max() < 0.05 * want.abs().max()


def sigmoid_without_selection_bias(model):
    """The zoo model with each router swapped for scored-topk's sigmoid routing without a selection bias (its rows,
    renormalisation and scale kept)."""
    from zoo.components.registry import registry

    scored, layers = registry.get("router", "scored-topk").obj, decoder_layers(model)
    for i, moe in moe_layers(model):
        old = moe.router
        router = scored(old.hidden_size, old.num_experts, old.top_k, score="sigmoid",
                        norm_topk_prob=old.norm_topk_prob, routed_scaling_factor=old.routed_scaling_factor)
        router.load_state_dict({"weight": old.weight})
        put_block(layers[i], moe.with_parts(router))
    sync_layout(model)
    return model


def test_a_padded_layer_without_a_selection_bias_gets_one(tmp_path):
    """dots1 with sigmoid routing and no selection bias (llama.cpp's dots1 reads one where a layer has it): the padded
    layer gets exp_probs_b, 0 for its own experts (chosen by their scores alone) and the lowest f32 for the padded."""
    model = pruned(sigmoid_without_selection_bias(zoo.convert(native("dots1", n_group=1, topk_group=1,
                                                                      num_experts_per_tok=4))), {1: [0, 2, 3, 5, 6, 7]})
    report = export_gguf(model, tmp_path / "d.gguf", progress=False)
    W, F_, shapes, arch = read(tmp_path / "d.gguf")
    assert [n for n in shapes if "exp_probs_b" in n] == ["blk.1.exp_probs_b.bias"]
    assert torch.equal(W["blk.1.exp_probs_b.bias"], torch.tensor([0.0] * 6 + [torch.finfo(torch.float32).min] * 2))
    assert report.padding == {"num_experts": 8, "layers": {1: 2}, "bytes": 2 * 3 * 32 * 64 * 4 + 2 * 64 * 4 + 8 * 4}
    check_file_layout(shapes, F_, arch, model.config)
    check_logits(model, tmp_path / "d.gguf")


def drop_one_k(model):
    moe_layers(model)[0][1].router.top_k = 1  # layer 1 routes to 1 expert, layer 2 to 4
    sync_layout(model)
    return model


@pytest.mark.parametrize("label, make, needle", [
    ("softmax without a bias", lambda: pruned(zoo.convert(tiny.tiny_native("mixtral")), {0: [0, 1, 3]}),
     "no bias with which a padded expert could never be chosen"),
    ("qwen2moe", lambda: pruned(zoo.convert(native("qwen2_moe", mlp_only_layers=[])), {1: [0, 2, 3, 5]}),
     "no bias with which a padded expert could never be chosen"),
    ("softmax with a bias arch", lambda: pruned(zoo.convert(tiny.tiny_native("deepseek_v2")), {1: [0, 1, 3]}),
     r"share exp\(0\) of every token's softmax"),
    ("different k", lambda: drop_one_k(deepseek_ungrouped()),
     r"different numbers of experts \[1, 4\]: GGUF has one expert_used_count"),
    ("groups turned off by pruning",
     lambda: pruned(zoo.convert(tiny.tiny_native("deepseek_v3")), {1: [0, 1, 2, 4, 5, 6]}),
     "layer 1: 6 experts, picked among all; layer 2: 8 experts, picked among the best 2 of 4 groups of 2"),
    ("groups of one", lambda: pruned(zoo.convert(tiny.tiny_native("deepseek_v3")), {1: [0, 2, 4, 6]}, keep_in_groups),
     "keeps 1 expert in each of its 4 groups: llama.cpp scores a group by its two best"),
])
def test_padding_llama_cpp_cannot_make_exact_is_refused(tmp_path, label, make, needle):
    model = make()
    with pytest.raises(NotGGUFExportable, match=needle):
        export_gguf(model, tmp_path / "x.gguf", progress=False)
    assert list(tmp_path.iterdir()) == [], label


def tiny_native_generic(family: str):
    """A tiny native model of a family ``tests/tiny.py`` has no config for (``tests/families``' tiny configs)."""
    from families.tiny_configs import tiny_config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "tiny_config", tiny_config)
        return tiny.tiny_native(family)


def same_file(a_path, b_path) -> bool:
    a, fa, _, _ = read(a_path)
    b, fb, _, _ = read(b_path)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and \
        {k: v for k, v in fa.items() if k != "general.name"} == {k: v for k, v in fb.items() if k != "general.name"}


def test_a_saved_zoo_folder_exports_the_same_file_as_the_model(tmp_path):
    """The zoo's own names (router.*, shared_experts.gate) map like the model's."""
    for family, changes in (("deepseek_v3", {}), ("qwen2_moe", {"mlp_only_layers": []}), ("granitemoeshared", {})):
        model = zoo.convert(native(family, **changes)).eval()
        model.save_pretrained(tmp_path / family)
        export_gguf(model, tmp_path / f"{family}-m.gguf", progress=False)
        export_gguf(tmp_path / family, tmp_path / f"{family}-f.gguf", progress=False)
        assert same_file(tmp_path / f"{family}-m.gguf", tmp_path / f"{family}-f.gguf"), family


def test_a_native_model_in_memory_exports_the_file_of_its_conversion(tmp_path):
    """Unconverted: the family's own names (gate, shared_expert(s), e_score_correction_bias), routing from its config."""
    for family, changes in (("deepseek_v3", {}), ("qwen2_moe", {"mlp_only_layers": []}),
                            ("olmoe", {"num_key_value_heads": 4})):
        export_gguf(native(family, **changes), tmp_path / f"{family}-n.gguf", progress=False)
        export_gguf(zoo.convert(native(family, **changes)), tmp_path / f"{family}-z.gguf", progress=False)
        assert same_file(tmp_path / f"{family}-n.gguf", tmp_path / f"{family}-z.gguf"), family


def test_a_saved_zoo_folder_is_checked_by_its_layout(tmp_path):
    """A folder's zoo_layout says which router its layers run: a swapped one is refused like the model's."""
    swapped = zoo.apply(zoo.convert(tiny.tiny_native("deepseek_v3")), "topk-softmax")
    swapped.save_pretrained(tmp_path / "m")
    with pytest.raises(NotGGUFExportable, match="layer 1: llama.cpp's deepseek2 layers run DeepSeek's sigmoid"):
        export_gguf(tmp_path / "m", tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_cli_loads_native_folders_it_cannot_stream(tmp_path):
    """A DeepSeek-V3 folder is loaded and converted (only the llama/qwen3moe families stream); a Mixtral folder with
    each expert stored apart (what transformers writes) streams, its experts stacked layer by layer, to the same file
    as the model in memory."""
    import gguf
    from click.testing import CliRunner

    from zoo.cli import cli
    from zoo.io.gguf_export import native_folder

    for family in ("deepseek_v3", "mixtral"):
        model = tiny.tiny_native(family)
        model.save_pretrained(tmp_path / family)
        streams = native_folder(str(tmp_path / family)) is not None
        assert streams == (family == "mixtral")
        result = CliRunner().invoke(cli, ["export", str(tmp_path / family), str(tmp_path / f"{family}.gguf"),
                                          "--format", "gguf"])
        assert result.exit_code == 0, result.output
        if family == "deepseek_v3":
            check_logits(model, tmp_path / f"{family}.gguf")
        else:
            export_gguf(zoo.convert(model), tmp_path / "in-memory.gguf", progress=False)
            a = {t.name: bytes(t.data) for t in gguf.GGUFReader(tmp_path / "mixtral.gguf").tensors}
            b = {t.name: bytes(t.data) for t in gguf.GGUFReader(tmp_path / "in-memory.gguf").tensors}
            assert a.keys() == b.keys() and a == b


def test_quantized_experts_of_qwen2_moe_keep_their_codes(tmp_path):
    model = zoo.convert(native("qwen2_moe", mlp_only_layers=[], moe_intermediate_size=64)).eval()
    model = zoo.apply(model, "quantize", bits=8)
    report = export_gguf(model, tmp_path / "q.gguf", progress=False)
    assert report.types["Q8_0"] == 3 * model.config.num_hidden_layers and report.max_rel_change < 2e-3
    _, F_, shapes, arch = read(tmp_path / "q.gguf")
    check_file_layout(shapes, F_, arch, model.config)
    with torch.no_grad():
        want = model(IDS[None]).logits[0]
    assert (gguf_forward(tmp_path / "q.gguf", IDS) - want).abs().max() < 0.05 * want.abs().max()


def test_a_native_model_of_a_generically_converted_family_is_sent_to_its_conversion(tmp_path):
    with pytest.raises(NotGGUFExportable, match="reads the zoo's conversion"):
        export_gguf(tiny.tiny_native("granitemoe"), tmp_path / "x.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("label, make, needle", [
    ("qwen2 dense layer", lambda: native("qwen2_moe"), "every layer MoE"),
    ("qwen2 renormalised", lambda: native("qwen2_moe", mlp_only_layers=[], norm_topk_prob=True),
     "does not renormalise"),
    ("olmoe gqa", lambda: native("olmoe"), "key/value heads"),
    ("gpt-oss yarn", lambda: native("gpt_oss"), "truncate=False"),
    ("qwen2 sigmoid router", lambda: zoo.apply(zoo.convert(native("qwen2_moe", mlp_only_layers=[])), "sigmoid-bias"),
     "softmax top-k"),
    ("deepseek softmax router", lambda: zoo.apply(zoo.convert(tiny.tiny_native("deepseek_v3")), "topk-softmax"),
     "sigmoid routing"),
    ("deepseek quantized kv_b", lambda: zoo.apply(zoo.convert(native("deepseek_v3", q_lora_rank=32, kv_lora_rank=32)),
                                                  "quantize", bits=8, targets="all"), "kv_b_proj.weight is quantized"),
    ("granite zero multiplier", lambda: native("granitemoe", residual_multiplier=0.0), "residual_multiplier=0"),
    ("granite sigmoid router", lambda: zoo.apply(zoo.convert(tiny.tiny_native("granitemoe")), "sigmoid-bias"),
     "softmax top-k"),
    ("phimoe", lambda: tiny_native_generic("phimoe"), "LayerNorms"),
    ("ernie interleaved", lambda: native("ernie4_5_moe", num_hidden_layers=4, moe_layer_interval=2),
     "MoE layers every 2"),
    ("hunyuan attention bias", lambda: native("hunyuan_v1_moe", attention_bias=True), "attention output"),
    ("dots1 gqa", lambda: native("dots1", num_key_value_heads=2), "key/value heads"),
    ("deepseek_v2 grouped", lambda: native("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=1),
     "scored by their max"),
])
def test_what_llama_cpp_cannot_run_is_refused_and_no_file_is_left(tmp_path, label, make, needle):
    model = make()
    model = zoo.convert(model) if not model.config.model_type.startswith("zoo_") else model
    with pytest.raises(NotGGUFExportable, match=needle):
        export_gguf(model, tmp_path / "x.gguf", progress=False)
    assert list(tmp_path.iterdir()) == [], label


@pytest.mark.parametrize("family, changes", [("qwen2_moe", {"mlp_only_layers": []}),
                                             ("olmoe", {"num_key_value_heads": 4}), ("deepseek_v3", {}),
                                             ("granitemoe", {}), ("granitemoeshared", {"attention_bias": True}),
                                             ("ernie4_5_moe", {}), ("hunyuan_v1_moe", {}), ("dots1", {}),
                                             ("glm4_moe", {}), ("deepseek_v2", {})])
def test_llama_cpp_runs_each_family_with_the_zoos_logits(tmp_path, family, changes):
    """Where llama-cpp-python is installed (``make test-clients`` builds it): llama.cpp itself loads the file (with
    the zoo's tokenizer, which llama.cpp needs: the vocabulary is made its size) and gives the zoo model's logits."""
    llama_cpp_matches(tmp_path, family, lambda vocab: zoo.convert(native(family, vocab_size=vocab, **changes)))


@pytest.mark.parametrize("label, make", [
    ("layer 1 pruned to 6 of 8", lambda vocab: pruned(deepseek_ungrouped(vocab_size=vocab), {1: [0, 2, 3, 5, 6, 7]})),
    ("layer 1 keeping 2 of each group of 3", lambda vocab: pruned(
        zoo.convert(native("deepseek_v3", n_routed_experts=12, vocab_size=vocab)), {1: [0, 1, 3, 4, 6, 7, 9, 10]},
        keep_in_groups)),
    ("dots1 without a selection bias", lambda vocab: pruned(sigmoid_without_selection_bias(zoo.convert(
        native("dots1", n_group=1, topk_group=1, num_experts_per_tok=4, vocab_size=vocab))), {1: [0, 2, 3, 5, 6, 7]})),
])
def test_llama_cpp_runs_padded_layers_with_the_zoos_logits(tmp_path, label, make):
    """llama.cpp itself never picks the padded experts: the zoo model's logits and greedy tokens."""
    report = llama_cpp_matches(tmp_path, label, make)
    assert report.padded_experts in (2, 4)


def llama_cpp_matches(tmp_path, label: str, make):
    """llama.cpp (where llama-cpp-python is installed) runs the GGUF file of the zoo model ``make(vocab_size)``,
    saved beside the zoo's tokenizer and loaded back, and gives its logits: the same greedy next token after every
    prefix. The export's report."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make test-clients)")
    from zoo.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    make(len(tokenizer)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    model = zoo.load(tmp_path / "m", dtype=torch.float32).eval()
    report = export_gguf(model, tmp_path / "m.gguf", progress=False)
    f32 = int(gguf.GGMLQuantizationType.F32)  # an fp32 cache: fp16 keys/values would blur a mistake (1e-3)
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=f32, type_v=f32)
    llm.eval(IDS.tolist())
    with torch.no_grad():
        want = model(IDS[None]).logits[0]
    got = torch.tensor(np.array(llm.scores[:len(IDS)]))
    print(f"{label}: llama.cpp's max |logit difference| {float((got - want).abs().max()):.2e} (logits up to "
          f"{float(want.abs().max()):.2f})")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy next token after every prefix
    return report
