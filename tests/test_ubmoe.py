"""ubmoe: the uni-bi-directional MoE. Its pieces against naive references, outputs and gradients: SimCSE's loss
against a loop over rows, the bidirectional reading against a hand-written decoder with unmasked attention, a
UBMoE layer against a per-token loop over the original FFN and the tuned copy (with the straight-through router
gradient equal to the dense mixture's); the experts forced one way reproduce the original model and the tuned
copy; refusals leave the model bit-identical; save/reload (``zoo.testing.check_component``: tests/test_check_component.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mistral.modeling_mistral import apply_rotary_pos_emb

import zoo
from zoo.moe.layout import moe_layers
from zoo.testing import tiny_model
from zoo_adapters.ubmoe import Ubmoe, embed, is_ubmoe, ubmoe_routers
from zoo_adapters.ubmoe_train import last_hidden, mean_pool, only_expert, simcse_loss, straight_through

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = torch.randint(3, 64, (8, 12), generator=torch.Generator().manual_seed(5)).tolist()
OPTIONS = {"bi_steps": 3, "router_steps": 3, "batch_size": 4, "data": ROWS, "bi_lr": 1e-2, "router_lr": 1e-1}


@pytest.fixture(scope="module")
def dense():
    return tiny_model("mistral")


@pytest.fixture(scope="module")
def ubmoe(dense):
    return zoo.apply(copy.deepcopy(dense), "ubmoe", **OPTIONS)


def ids(seed=0, rows=2, length=10):
    return torch.randint(3, 64, (rows, length), generator=torch.Generator().manual_seed(seed))


def state_bytes(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tuned_copy(dense, moe_model):
    """The dense model with every FFN replaced by the UBMoE layer's expert ``1`` (gate rows first, then up)."""
    out = copy.deepcopy(dense)
    with torch.no_grad():
        for layer, (_, moe) in zip(out.model.layers, moe_layers(moe_model)):
            gate_up, down = moe.experts.gate_up_proj[1], moe.experts.down_proj[1]
            inter = down.shape[1]
            layer.mlp.gate_proj.weight.copy_(gate_up[:inter])
            layer.mlp.up_proj.weight.copy_(gate_up[inter:])
            layer.mlp.down_proj.weight.copy_(down)
    return out


# ---- the pieces against naive references ---------------------------------------------------------------------

def test_simcse_loss_matches_a_loop_over_rows_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(5, 7, generator=g, dtype=torch.float64).requires_grad_()
    fast = simcse_loss(a, b, 0.05)
    terms = []
    for i in range(5):
        sims = torch.stack([torch.dot(a[i], b[j]) / (a[i].norm() * b[j].norm()) / 0.05 for j in range(5)])
        terms.append(-(sims[i] - torch.log(torch.exp(sims).sum())))
    slow = sum(terms) / 5
    torch.testing.assert_close(fast.double(), slow)
    for x, y in zip(torch.autograd.grad(fast, (a, b)), torch.autograd.grad(slow, (a, b))):
        torch.testing.assert_close(x.double(), y)


def hand_decoder(model, input_ids, causal: bool):
    """A Mistral decoder written out: unmasked softmax attention (``causal``: the lower triangle only)."""
    base, cfg = model.model, model.config
    B, S = input_ids.shape
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(h, torch.arange(S)[None])
    for layer in base.layers:
        attn, x = layer.self_attn, layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, S, heads, hd).transpose(1, 2)
        k = attn.k_proj(x).view(B, S, kv, hd).transpose(1, 2)
        v = attn.v_proj(x).view(B, S, kv, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = q @ k.transpose(-1, -2) / hd ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, heads * hd)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return base.norm(h)


def test_bidirectional_reading_matches_a_hand_written_decoder_and_ignores_padding(dense):
    x = ids(1)
    torch.testing.assert_close(last_hidden(dense, x, bidirectional=False), hand_decoder(dense, x, causal=True))
    both = last_hidden(dense, x)
    torch.testing.assert_close(both, hand_decoder(dense, x, causal=False))
    # gradients too (of the embedding table, through every layer)
    d = torch.randn(both.shape, generator=torch.Generator().manual_seed(2))
    table = dense.model.embed_tokens.weight
    fast, = torch.autograd.grad((last_hidden(dense, x) * d).sum(), table)
    slow, = torch.autograd.grad((hand_decoder(dense, x, causal=False) * d).sum(), table)
    torch.testing.assert_close(fast, slow)
    # the first token sees the last one (not so causally)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 3) % 61 + 3
    assert not torch.allclose(last_hidden(dense, changed)[:, 0], both[:, 0])
    assert torch.allclose(last_hidden(dense, changed, bidirectional=False)[:, 0],
                          last_hidden(dense, x, bidirectional=False)[:, 0])
    # right padding: the real tokens read as the unpadded row, and the mean pools them alone
    padded = torch.cat([x[:1, :6], torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 6 + [0] * 4])
    torch.testing.assert_close(embed(dense, padded, mask), embed(dense, x[:1, :6]))
    torch.testing.assert_close(mean_pool(hand_decoder(dense, x[:1, :6], causal=False)), embed(dense, x[:1, :6]))


def test_a_ubmoe_layer_matches_a_per_token_loop_with_the_mixture_gradient_for_its_router(dense, ubmoe):
    block, original = moe_layers(ubmoe)[0][1], dense.model.layers[0].mlp
    router = block.router
    inter = block.experts.down_proj.shape[2]

    def copy_ffn(x):  # the tuned copy, from the stored weights: down(silu(gate x) * up x)
        gate_up, down = block.experts.gate_up_proj[1], block.experts.down_proj[1]
        return down @ (F.silu(gate_up[:inter] @ x) * (gate_up[inter:] @ x))

    x = torch.randn(9, dense.config.hidden_size, generator=torch.Generator().manual_seed(3)).requires_grad_()
    direction = torch.randn(9, dense.config.hidden_size, generator=torch.Generator().manual_seed(4))

    def loop(straight):
        rows = []
        for t in range(len(x)):
            p = (router.weight @ x[t]).softmax(-1)
            outs = [original(x[t]), copy_ffn(x[t])]
            chosen = int(p.argmax())
            row = outs[chosen]
            if straight:  # the value of the chosen FFN, the gradient of the dense mixture
                row = row + sum((p[e] - p[e].detach()) * outs[e] for e in range(2))
            rows.append(row)
        return torch.stack(rows)

    plain = block(x)
    torch.testing.assert_close(plain, loop(False))
    with straight_through([router]):
        fast = block(x)
    slow = loop(True)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(fast, plain)  # no value changes (the 2-slot dispatch sums in another order)
    wrt = (x, router.weight)
    for a, b in zip(torch.autograd.grad((fast * direction).sum(), wrt),
                    torch.autograd.grad((slow * direction).sum(), wrt)):
        torch.testing.assert_close(a, b)
    # the router's gradient is the dense softmax mixture's, experts' outputs held fixed
    (mix_grad,) = torch.autograd.grad(sum(
        ((router.weight @ x[t]).softmax(-1) * torch.stack([original(x[t]), copy_ffn(x[t])]).detach().T).sum(-1)
        @ direction[t] for t in range(len(x))), router.weight)
    with straight_through([router]):
        (st_grad,) = torch.autograd.grad((block(x) * direction).sum(), router.weight)
    torch.testing.assert_close(st_grad, mix_grad)
    # without the estimator the renormalised top-1 weight is the constant 1 (w / w): no gradient reaches the router
    assert router.weight.grad is None
    (plain_grad,) = torch.autograd.grad((block(x) * direction).sum(), router.weight, allow_unused=True)
    assert plain_grad is None or plain_grad.abs().max() < 1e-5 * st_grad.abs().max()  # rounding only


def test_forced_experts_reproduce_the_original_and_the_tuned_copy(dense, ubmoe):
    x = ids(6)
    with only_expert(ubmoe_routers(ubmoe), 0):
        torch.testing.assert_close(ubmoe(input_ids=x).logits, dense(input_ids=x).logits)
    bi = tuned_copy(dense, ubmoe)
    with only_expert(ubmoe_routers(ubmoe), 1):
        torch.testing.assert_close(ubmoe(input_ids=x).logits, bi(input_ids=x).logits)
    torch.testing.assert_close(embed(ubmoe, x), mean_pool(hand_decoder(bi, x, causal=False)))
    torch.testing.assert_close(embed(ubmoe, x, expert="uni", attention="causal"), embed(dense, x, attention="causal"))
    assert not torch.allclose(embed(ubmoe, x), embed(dense, x))  # the copy was tuned


def test_only_the_second_expert_is_tuned_and_only_the_routers_train_afterwards(dense, ubmoe):
    ours, theirs = ubmoe.state_dict(), dense.state_dict()
    for key, value in theirs.items():
        if ".mlp." not in key:
            assert torch.equal(ours[key], value), key  # attention, norms, embeddings untouched
    for i, (_, moe) in enumerate(moe_layers(ubmoe)):
        mlp = dense.model.layers[i].mlp
        assert torch.equal(moe.experts.gate_up_proj[0], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert torch.equal(moe.experts.down_proj[0], mlp.down_proj.weight)
        assert not torch.equal(moe.experts.down_proj[1], mlp.down_proj.weight)
        assert moe.num_experts == 2 and moe.top_k == 1
    assert {n for n, p in ubmoe.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.mlp.router.weight" for i in range(2)}
    step = ubmoe.config.zoo_recipe[-1]
    assert step["name"] == "ubmoe" and step["options"] == OPTIONS
    assert len(step["results"]["bi expert share"]) == 2 and len(step["results"]["bi contrastive loss"]) == 2


def test_the_stage_two_loss_reaches_the_routers_and_router_training_moves_them_alone(dense):
    model = zoo.apply(copy.deepcopy(dense), "ubmoe", **{**OPTIONS, "router_steps": 0})
    before = state_bytes(model)
    loss, lm = Ubmoe(**OPTIONS).loss(model, ids(7, 4))
    assert loss is lm
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == {"model.layers.0.mlp.router.weight", "model.layers.1.mlp.router.weight"}
    assert all(g.abs().sum() > 0 for g in grads.values())
    trained = zoo.apply(copy.deepcopy(dense), "ubmoe", **{**OPTIONS, "router_steps": 4})
    for key, value in trained.state_dict().items():
        assert torch.equal(value, before[key]) == (".router." not in key), key  # same stage 1 (same seed)


def test_the_contrastive_stage_lowers_its_loss(dense):
    model = zoo.apply(copy.deepcopy(dense), "ubmoe", **{**OPTIONS, "bi_steps": 30, "router_steps": 0})
    first, last = model.config.zoo_recipe[-1]["results"]["bi contrastive loss"]
    assert last < first


# ---- refusals, save/reload, the checker ----------------------------------------------------------------------

@pytest.mark.parametrize("options, error", [
    ({"bi_steps": 0}, "bi_steps"), ({"temperature": 0.0}, "temperature"), ({"dropout": 1.0}, "dropout"),
    ({"batch_size": 1}, "batch_size"), ({"router_steps": -1}, "router_steps"), ({"bi_step": 3}, "bi_steps"),
    ({"data": [[3, 4]]}, "data"), ({"data": [[3, 4, 5], [3, 4]]}, "data"), ({"data": [[3, -1], [4, 5]]}, "data"),
    ({"data": [[3, 4], [5, 64]]}, "vocabulary"), ({"seed": "1"}, "seed"),
])
def test_bad_options_are_refused_leaving_the_model_bit_identical(dense, options, error):
    model = copy.deepcopy(dense)
    before = state_bytes(model)
    with pytest.raises(ValueError, match=error):
        zoo.apply(model, "ubmoe", **{**OPTIONS, **options})
    assert type(model) is type(dense) and state_bytes(model).keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in state_bytes(model).items())


def test_models_it_cannot_pair_are_refused(dense):
    moe = tiny_model("mixtral")
    before = state_bytes(moe)
    with pytest.raises(TypeError, match="dense decoder"):
        zoo.apply(moe, "ubmoe", **OPTIONS)
    assert all(torch.equal(v, before[k]) for k, v in state_bytes(moe).items())
    with pytest.raises(ValueError, match="tokenizer"):  # no tokenizer for a 64-token vocabulary, no data
        zoo.apply(copy.deepcopy(dense), "ubmoe", bi_steps=1)
    with pytest.raises(ValueError, match="no UBMoE"):
        embed(dense, ids(), expert="bi")
    with pytest.raises(ValueError, match="did you mean|bidirectional"):
        embed(dense, ids(), attention="bidirectionl")
    with pytest.raises(TypeError, match="not a UBMoE"):
        Ubmoe(**OPTIONS).loss(zoo.convert(moe), ids())


def test_save_and_reload_keep_the_function_and_the_embeddings(ubmoe, tmp_path):
    from transformers import AutoModelForCausalLM

    x = ids(8)
    ubmoe.save_pretrained(tmp_path)
    for again in (zoo.load(str(tmp_path), dtype=torch.float32), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert is_ubmoe(again)
        torch.testing.assert_close(again(input_ids=x).logits, ubmoe(input_ids=x).logits, rtol=0, atol=0)
        torch.testing.assert_close(embed(again, x), embed(ubmoe, x), rtol=0, atol=0)
        torch.testing.assert_close(embed(again, x, expert="router"), embed(ubmoe, x, expert="router"), rtol=0, atol=0)
