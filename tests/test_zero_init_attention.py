"""zero-init-attention: the model bit-identical at init (zero gate) on every family, the prompted attention against an
attention written out by hand (outputs and gradients; zero-init and vanilla, linear and non-linear prompts, eager and
sdpa, q/k-norms), KV-cache decoding, training, refused options leaving the model bit-identical, save/reload, and
zoo.testing.check_component."""
# zoo is imported before zoo_adapters on purpose: importing a plugin first would register it half-initialised.
import copy  # noqa: I001

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.testing import check_component
from zoo_adapters.zero_init_prompts import PromptedAttention
from tiny import FAMILIES, padded_batch, tiny_native

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")


def adapted(family="mixtral", **options):
    return zoo.apply(zoo.convert(tiny_native(family)), "zero-init-attention", **options)


def wrapped(model):
    return [m for m in model.modules() if isinstance(m, PromptedAttention)]


def open_gates(model, seed=0):
    """Non-zero gates (as training leaves them): the prompts then change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in wrapped(model):
            if m.gate is not None:
                m.gate.copy_(torch.randn(m.gate.shape, generator=g))
            if m.prompt == "non-linear":  # the generator's output layer starts tiny: give the prompts some size
                m.generator[2].weight.normal_(0, 0.3, generator=g)
    return model


def logits(model, ids=IDS, mask=MASK):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# ------------------------------------------------------------------ the model unchanged at init


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", ["linear", "non-linear"])
def test_logits_are_bit_identical_to_the_base_model_at_init(family, prompt):
    base = zoo.convert(tiny_native(family))
    want = logits(base)
    model = zoo.apply(base, "zero-init-attention", prompts=3, prompt=prompt)
    assert len(wrapped(model)) == len(model.model.layers)
    assert torch.equal(logits(model), want)
    assert not torch.equal(logits(open_gates(model)), want)  # the prompts are really there


def test_the_shipped_model_in_bfloat16_is_unchanged_at_init():
    model = zoo.load("zoo-tiny-moe")
    ids = torch.randint(3, 8000, (2, 12), generator=torch.Generator().manual_seed(0))
    want = logits(model, ids, None)
    zoo.apply(model, "zero-init-attention", layers=2)
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, PromptedAttention)] == [2, 3]
    assert torch.equal(logits(model, ids, None), want)


def test_vanilla_attention_changes_the_model_at_once():
    base = zoo.convert(tiny_native("mixtral"))
    want = logits(base)
    model = zoo.apply(base, "zero-init-attention", prompts=3, attention="vanilla")
    assert all(m.gate is None for m in wrapped(model))
    assert not torch.allclose(logits(model), want, atol=1e-3)


# ------------------------------------------------------------------ against an attention written out by hand


def rms(t, norm):
    return norm.weight * (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def rotate(t, cos, sin):  # rotary by hand: t * cos + rotate_half(t) * sin, per position
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def prompts_by_hand(module):
    if module.prompt == "linear":
        return module.prompts
    first, last = module.generator[0], module.generator[2]
    hidden = torch.relu(first.weight @ module.seed + first.bias)
    return (last.weight @ hidden + last.bias).view(module.num_prompts, module.hidden_size)


def reference(module, x, cos, sin, mask):
    """The layer's output written out head by head and token by token: the tokens' causal, padding-masked softmax;
    zero-init adds tanh(g_h) times a separate softmax over the prompts (keys k_proj(P), values v_proj(P), no rotary);
    vanilla puts the prompts' scores into the tokens' softmax."""
    attn = module.attention
    B, S, _ = x.shape
    heads, d = module.heads, attn.head_dim
    kv_heads = attn.k_proj.out_features // d
    q = attn.q_proj(x).view(B, S, heads, d)
    k = attn.k_proj(x).view(B, S, kv_heads, d)
    v = attn.v_proj(x).view(B, S, kv_heads, d)
    P = prompts_by_hand(module)
    kp = attn.k_proj(P).view(-1, kv_heads, d)
    vp = attn.v_proj(P).view(-1, kv_heads, d)
    if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head's vector, before rotary
        q, k, kp = rms(q, attn.q_norm), rms(k, attn.k_norm), rms(kp, attn.k_norm)
    q, k = rotate(q, cos[:, :, None], sin[:, :, None]), rotate(k, cos[:, :, None], sin[:, :, None])
    out = torch.zeros(B, S, heads, d)
    for b in range(B):
        for h in range(heads):
            g = h // (heads // kv_heads)  # the kv head this query head reads
            for i in range(S):
                seen = [j for j in range(i + 1) if mask[b, j]]
                if not seen:  # a padding query before any real token: not compared
                    continue
                tok = torch.stack([q[b, i, h] @ k[b, j, g] for j in seen]) * d ** -0.5
                pro = (kp[:, g] @ q[b, i, h]) * d ** -0.5
                if module.gate is not None:
                    out[b, i, h] = (torch.softmax(tok, 0) @ v[b, seen, g]
                                    + torch.tanh(module.gate[h]) * (torch.softmax(pro, 0) @ vp[:, g]))
                else:
                    w = torch.softmax(torch.cat([pro, tok]), 0)
                    out[b, i, h] = w[:len(pro)] @ vp[:, g] + w[len(pro):] @ v[b, seen, g]
    return attn.o_proj(out.reshape(B, S, heads * d))


@pytest.mark.parametrize("family, implementation", [("mixtral", "sdpa"), ("mixtral", "eager"), ("qwen3_moe", "sdpa")])
@pytest.mark.parametrize("prompt, attention", [("linear", "zero-init"), ("non-linear", "zero-init"),
                                               ("linear", "vanilla"), ("non-linear", "vanilla")])
def test_forward_and_gradients_match_an_attention_written_by_hand(family, implementation, prompt, attention):
    model = open_gates(adapted(family, prompts=3, layers=1, prompt=prompt, attention=attention))
    model.set_attn_implementation(implementation)
    module = wrapped(model)[0]
    assert module is model.model.layers[-1].self_attn
    captured = {}
    module.register_forward_hook(lambda m, args, kwargs, out: captured.update(kwargs=kwargs), with_kwargs=True)
    model(input_ids=IDS, attention_mask=MASK, use_cache=False)
    kw = dict(captured["kwargs"])
    x = kw.pop("hidden_states").detach().requires_grad_()
    cos, sin = kw["position_embeddings"]
    got = module(hidden_states=x, **kw)[0]
    want = reference(module, x, cos, sin, MASK)
    real = MASK.bool()  # rows of padding queries see no key: not compared
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    direction = torch.randn(got[real].shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in module.parameters() if p.requires_grad]
    assert params and all(not p.requires_grad for p in module.attention.parameters())
    grads = torch.autograd.grad((got[real] * direction).sum(), [x, *params])
    expected = torch.autograd.grad((want[real] * direction).sum(), [x, *params])
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attention", ["zero-init", "vanilla"])
def test_eager_and_sdpa_give_the_same_model(attention):
    model = open_gates(adapted("mixtral", prompts=4, attention=attention))
    sdpa = logits(model)
    model.set_attn_implementation("eager")
    torch.testing.assert_close(logits(model)[MASK.bool()], sdpa[MASK.bool()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, attention", [("mixtral", "zero-init"), ("mixtral", "vanilla"),
                                               ("deepseek_v3", "zero-init"), ("gpt_oss", "zero-init")])
def test_kv_cache_decoding_matches_the_full_forward(family, attention):
    """The prompts are every step's: decoding token by token with a cache gives the full forward's logits."""
    model = open_gates(adapted(family, prompts=3, prompt="non-linear", attention=attention))
    ids = IDS[:1]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :4], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(4, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_at_init_only_the_gates_get_a_gradient():
    """tanh(0) = 0 multiplies the prompts' term: their gradient is exactly zero until the gates open, while the
    gates' own gradient (through the prompts' softmax output) is not."""
    model = adapted("mixtral", prompts=3)
    model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss.backward()
    for m in wrapped(model):
        assert torch.count_nonzero(m.prompts.grad) == 0
        assert m.gate.grad.abs().min() > 0


def test_training_moves_only_the_prompts_and_gates_and_lowers_the_loss():
    model = adapted("mixtral", prompts=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.rsplit(".", 1)[-1] in ("prompts", "gate") for n in trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses
    assert all(m.gate.abs().max() > 0 for m in wrapped(model))  # the gates opened
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


# ------------------------------------------------------------------ refusals leave the model bit-identical


def state(model):
    return (type(model), [type(layer.self_attn) for layer in model.model.layers],
            {k: v.clone() for k, v in model.state_dict().items()},
            copy.deepcopy(getattr(model.config, "zoo_recipe", None)), getattr(model.config, "zoo_modules", None))


def assert_same(model, before):
    cls, attn, tensors, recipe, modules = before
    assert type(model) is cls and [type(layer.self_attn) for layer in model.model.layers] == attn
    now = model.state_dict()
    assert now.keys() == tensors.keys() and all(torch.equal(v, tensors[k]) for k, v in now.items())
    assert getattr(model.config, "zoo_recipe", None) == recipe and getattr(model.config, "zoo_modules", None) == modules
    assert all(type(getattr(layer.self_attn, "config", None)).__name__ != "AttentionView"
               for layer in model.model.layers if not isinstance(layer.self_attn, PromptedAttention))


@pytest.mark.parametrize("options, error, message", [
    ({"prompts": 0}, ValueError, "prompts must be an integer"),
    ({"prompts": 2.5}, ValueError, "'prompts' of zero-init-attention must be int"),
    ({"layers": 0}, ValueError, "layers must be an integer"),
    ({"layers": 3}, ValueError, "layers=3, but this model has 2 decoder layers"),
    ({"prompt": "nonlinear"}, ValueError, "did you mean 'non-linear'"),
    ({"attention": "vanila"}, ValueError, "did you mean 'vanilla'"),
    ({"gate_init": float("nan")}, ValueError, "gate_init"),
    ({"hidden": 0}, ValueError, "hidden must be an integer"),
    ({"prompt_kind": "linear"}, ValueError, "unknown option 'prompt_kind'"),
    ({"promts": 4}, ValueError, "did you mean 'prompts'"),
])
@pytest.mark.parametrize("native", [False, True])
def test_bad_options_leave_the_model_bit_identical(options, error, message, native):
    model = tiny_native("mixtral") if native else zoo.convert(tiny_native("mixtral"))
    before = state(model)
    with pytest.raises(error, match=message):
        zoo.apply(model, "zero-init-attention", **options)
    assert_same(model, before)


@pytest.mark.parametrize("case", ["twice", "after mixture-of-heads", "mixture-of-heads after", "vanilla with sinks",
                                  "multimodal attention"])
def test_models_it_cannot_hold_are_refused_unchanged(case):
    if case == "twice":
        model, name, options, message = adapted("mixtral", layers=1), "zero-init-attention", {}, "already has"
    elif case == "after mixture-of-heads":
        model = zoo.apply(zoo.convert(tiny_native("mixtral")), "mixture-of-heads", heads_per_token=0.5)
        name, options, message = "zero-init-attention", {}, "already wrapped"
    elif case == "mixture-of-heads after":
        model, name, options, message = adapted("mixtral"), "mixture-of-heads", {"heads_per_token": 0.5}, "o_proj"
    elif case == "vanilla with sinks":
        model = zoo.convert(tiny_native("gpt_oss"))
        name, options, message = "zero-init-attention", {"attention": "vanilla"}, "sinks"
    else:
        from zoo.testing import tiny_model

        model, name, options, message = tiny_model("zoo_mm"), "zero-init-attention", {}, "attention interface"
    before = state(model)
    with pytest.raises(TypeError, match=message):
        zoo.apply(model, name, **options)
    assert_same(model, before)


# ------------------------------------------------------------------ save / reload, check_component


@pytest.mark.parametrize("options", [{"prompts": 3, "prompt": "non-linear", "layers": 1}, {"attention": "vanilla"}])
def test_save_and_reload_give_the_same_logits(tmp_path, options):
    model = open_gates(adapted("mixtral", **options))
    want = logits(model)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert [type(layer.self_attn) for layer in again.model.layers] == [type(layer.self_attn)
                                                                      for layer in model.model.layers]
    if options.get("prompt") == "non-linear":  # the loaded generator weights lie at another alignment (the file's
        torch.testing.assert_close(logits(again), want, rtol=0, atol=1e-6)  # mmap): BLAS rounds its matvec apart
    else:
        assert torch.equal(logits(again), want)
    spec = next(iter(again.config.zoo_modules.values()))
    assert spec["adapter"] == "zero-init-attention" and spec["attention"] == options.get("attention", "zero-init")
    assert again.config.zoo_recipe[-1]["name"] == "zero-init-attention"
    assert again.config.zoo_recipe[-1]["options"] == options
    assert "Adapter: zero-init-attention" in (tmp_path / "README.md").read_text()


# the non-linear prompts are checked by tests/test_check_component.py (its OPTIONS)
@pytest.mark.parametrize("options", [{"prompts": 2, "attention": "vanilla"}])
def test_check_component(options):
    report = check_component("zero-init-attention", families=["mixtral", "qwen2_moe", "deepseek_v3"], **options)
    assert report["families"] == ["mixtral", "qwen2_moe", "deepseek_v3"], report
