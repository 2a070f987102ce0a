"""remix (router), mixture-of-loras and replora (adapters): each against a naive reference (outputs and gradients),
the RLOO gradient against its explicit per-sample formula, option checks, save/reload and a few training steps."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from tiny import padded_batch, reload_max_diff, tiny_native
from torch import nn
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers

# isort: split
# (after ``import zoo``: importing a plugin module first would run the plugin hooks on a half-imported module)
from zoo_adapters.mixture_of_loras import (
    MixtureOfLoras,
    MixtureOfLorasLinear,
    mixture_modules,
)
from zoo_adapters.replora import RepLora, RepLoraLinear
from zoo_routers.remix import (
    Remix,
    plackett_luce_log_prob,
    remix_routers,
    rloo_advantages,
    rloo_loss,
)

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0):
    return zoo.convert(tiny_native("mixtral", seed=seed))


@torch.no_grad()
def randomize(model, names=("lora_B", "mlp_B.2"), std=0.2, seed=1):
    """Adapters start as the identity (B = 0); give their up-projections values so they change the output."""
    g = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if any(k in n for k in names):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- remix router --------------------------------------------------------------------------------------------

def test_remix_samples_distinct_experts_with_equal_weights_and_is_topk_at_eval():
    torch.manual_seed(0)
    router = Remix(16, 6, 3)
    x = torch.randn(40, 16)
    routing = router(x)
    assert routing.indices.shape == routing.weights.shape == (40, 3) and routing.logits.shape == (40, 6)
    assert all(len(set(row.tolist())) == 3 for row in routing.indices)
    assert torch.equal(routing.weights, torch.full((40, 3), 1 / 3)) and not routing.weights.requires_grad
    assert router.log_prob.shape == (40,) and router.log_prob.requires_grad
    router.eval()
    routing = router(x)
    assert torch.equal(routing.indices, routing.logits.topk(3).indices) and router.log_prob is None
    assert torch.equal(routing.weights, torch.full((40, 3), 1 / 3))


def test_plackett_luce_log_prob_matches_the_sequential_formula():
    torch.manual_seed(0)
    logits, idx = torch.randn(7, 5), torch.stack([torch.randperm(5)[:3] for _ in range(7)])
    got = plackett_luce_log_prob(logits, idx)
    for t in range(7):
        p, left, ref = logits[t].softmax(-1), 1.0, 0.0
        for i in idx[t].tolist():
            ref += torch.log(p[i] / left)
            left -= p[i]
        assert torch.allclose(got[t], ref, atol=1e-5)
    # a distribution over ordered draws: the probabilities of all k-permutations sum to one
    all_draws = torch.tensor(list(itertools.permutations(range(5), 3)))
    total = plackett_luce_log_prob(logits[:1].expand(len(all_draws), 5), all_draws).exp().sum()
    assert torch.allclose(total, torch.tensor(1.0), atol=1e-5)


def test_remix_swaps_moe_routers_and_keeps_the_gates():
    model = tiny()
    gates = [m.router.weight.clone() for _, m in moe_layers(model)]
    zoo.apply(model, "remix", num_samples=3)
    routers = [m.router for _, m in moe_layers(model)]
    assert all(isinstance(r, Remix) and r.num_samples == 3 for r in routers)
    assert all(torch.equal(r.weight, g) for r, g in zip(routers, gates))
    assert model.config.zoo_layout[0]["router"] == "remix"
    with pytest.raises(ValueError, match="num_samples must be an integer >= 2"):
        zoo.apply(model, "remix", num_samples=1)


def test_rloo_gradient_matches_the_explicit_per_sample_formula():
    """One batched rloo_loss against S separate forwards with the same draws, rewards and log pi computed
    token by token, and the RLOO weights (R_s - mean of the other R) written out."""
    model = tiny()
    zoo.apply(model, "mixture-of-loras", num_loras=4, r=2, router="remix")
    randomize(model)
    model.train()
    routers = remix_routers(model)
    S, (B, L) = 3, IDS.shape
    drawn = {r: [] for r in routers}
    for r in routers:
        r.sample = lambda logits, r=r, f=r.sample: drawn[r].append(f(logits)) or drawn[r][-1]
    torch.manual_seed(0)
    out = rloo_loss(model, IDS, MASK, num_samples=S)
    out.surrogate.backward()
    got = [r.weight.grad.clone() for r in routers]

    rewards, log_pi = torch.zeros(S, B), [[0.0] * B for _ in range(S)]
    inputs = {}
    for r in routers:
        r.forward = lambda h, r=r, f=r.forward: inputs.__setitem__(r, h.detach()) or f(h)
    for s in range(S):
        for r in routers:
            r.sample = lambda logits, r=r, s=s: drawn[r][0].view(S, B * L, -1)[s]
        with torch.no_grad():
            logits = model(input_ids=IDS, attention_mask=MASK).logits
        for b in range(B):
            n = MASK[b, 1:].sum()
            ce = F.cross_entropy(logits[b, :-1], IDS[b, 1:], reduction="none")
            rewards[s, b] = -(ce * MASK[b, 1:]).sum() / n
            for r in routers:
                gate = inputs[r].view(B, L, -1)[b] @ r.weight.t()
                for t in range(L):
                    if MASK[b, t]:
                        p, left = gate[t].softmax(-1), 1.0
                        for i in drawn[r][0].view(S, B, L, -1)[s, b, t].tolist():
                            log_pi[s][b] = log_pi[s][b] + torch.log(p[i] / left)
                            left = left - p[i]
            log_pi[s][b] = log_pi[s][b] / MASK[b].sum()
    assert torch.allclose(rewards, out.rewards, atol=1e-5)
    ref = 0.0
    for s in range(S):
        for b in range(B):
            others = sum(rewards[j, b] for j in range(S) if j != s) / (S - 1)
            ref = ref - (rewards[s, b] - others) * log_pi[s][b]
    ref = ref / (S * B)
    want = torch.autograd.grad(ref, [r.weight for r in routers])
    assert any(g.abs().max() > 1e-6 for g in want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)


def test_rloo_estimate_is_unbiased_on_a_toy_reward():
    """Mean RLOO gradient over many draws ~ the exact gradient of E[reward], enumerated over all ordered pairs."""
    torch.manual_seed(0)
    router = Remix(6, 4, 2)
    h = torch.randn(1, 6)
    table = torch.tensor([[0, 1, 2, 3], [1, 0, -1, 4], [2, -1, 0, 1], [3, 4, 1, 0]], dtype=torch.float)
    pairs = torch.tensor(list(itertools.permutations(range(4), 2)))
    exact = (plackett_luce_log_prob(router.gate_logits(h).expand(len(pairs), 4), pairs).exp()
             * table[pairs[:, 0], pairs[:, 1]]).sum()
    want = torch.autograd.grad(-exact, router.weight)[0]
    S, n = 4, 20000
    idx = router.sample(router.gate_logits(h.expand(S * n, 6)).detach())  # fresh draws, scored below
    logp = plackett_luce_log_prob(router.gate_logits(h.expand(S * n, 6)), idx).view(S, n)
    rewards = table[idx[:, 0], idx[:, 1]].view(S, n)
    got = torch.autograd.grad(-(rloo_advantages(rewards) * logp).mean(), router.weight)[0]
    assert (got - want).norm() < 0.05 * want.norm()


# --- mixture-of-loras ----------------------------------------------------------------------------------------

def naive_mixture(module, x):
    """Token by token: base output plus each selected LoRA's B_i A_i x, scaled by its routing weight."""
    W, A, Bm, Wr = module.weight, module.lora_A, module.lora_B, module.router.weight
    rows = []
    for xt in x.reshape(-1, x.shape[-1]):
        logits = Wr @ xt
        idx = logits.topk(module.router.top_k).indices
        if module.kind == "learned":
            p = logits.softmax(-1)[idx]
            w = p / p.sum()
        else:
            w = torch.full((len(idx),), 1 / len(idx))
        y = W @ xt + module.bias
        for wi, i in zip(w, idx.tolist()):
            y = y + module.scale * wi * (Bm[i] @ (A[i] @ xt))
        rows.append(y)
    return torch.stack(rows).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("router", ["remix", "learned"])
def test_mixture_forward_and_gradients_match_a_naive_loop(router):
    torch.manual_seed(0)
    module = MixtureOfLorasLinear(nn.Linear(12, 10), num_loras=5, r=3, alpha=6.0, router=router, top_k=2).eval()
    nn.init.normal_(module.lora_B, std=0.3)
    nn.init.normal_(module.router.weight, std=0.5)
    x = torch.randn(2, 4, 12, requires_grad=True)
    params = [x, module.lora_A, module.lora_B] + ([module.router.weight] if router == "learned" else [])
    got, want = module(x), naive_mixture(module, x)
    assert torch.allclose(got, want, atol=1e-5)
    g1 = torch.autograd.grad((got ** 2).sum(), params)
    g2 = torch.autograd.grad((want ** 2).sum(), params)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)
    # learned: backprop reaches the router through its weights; remix: weights are constants, it never does
    assert g1[-1].abs().max() > 0 if router == "learned" else module.router.weight.grad is None
    assert got.grad_fn is not None and module.last_routing.indices.shape == (8, 2)


def test_mixture_attaches_to_attention_freezes_the_base_and_starts_as_identity():
    model = tiny()
    ref = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    zoo.apply(model, "mixture-of-loras", num_loras=4, r=2, top_k=2, router="learned")
    mods = mixture_modules(model)
    assert [n.rsplit(".", 1)[1] for n, _ in mods] == ["q_proj", "k_proj", "v_proj", "o_proj"] * 2
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(any(k in n for k in ("lora_A", "lora_B", ".router.")) for n in trainable)
    assert not any(n.endswith("proj.weight") for n in trainable)
    out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    assert torch.allclose(out.logits, ref.logits, atol=1e-6)  # B = 0 at init
    assert len(out.router_logits) == len(moe_layers(model))  # LoRA routers stay out of the MoE balance loss
    assert torch.allclose(out.aux_loss, ref.aux_loss)
    step = model.config.zoo_recipe[-1]
    assert step["name"] == "mixture-of-loras" and step["options"]["router"] == "learned"


@pytest.mark.parametrize("name, options, message", [
    ("mixture-of-loras", {"router": "soft"}, "router must be one of"),
    ("mixture-of-loras", {"num_loras": 4, "top_k": 5}, "top_k must be an integer"),
    ("mixture-of-loras", {"num_loras": 0}, "num_loras must be"),
    ("mixture-of-loras", {"num_samples": 1}, "num_samples must be"),
    ("mixture-of-loras", {"rank": 4}, "unknown option 'rank'"),
    ("mixture-of-loras", {"target": "q_proj,nope"}, "no linear layer named nope"),
    ("replora", {"hidden": 0}, "hidden must be"),
    ("replora", {"target": "q_proj,q_proj"}, "target must be a comma list"),
    ("replora", {"target": "gate_proj"}, "no linear layer named gate_proj"),
])
def test_bad_options_leave_the_model_unchanged(name, options, message):
    model = tiny()
    before, recipe = snapshot(model), list(model.config.zoo_recipe)
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, name, **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.config.zoo_recipe == recipe and not mixture_modules(model)
    assert all(p.requires_grad for p in model.parameters())


def test_a_layer_is_adapted_once():
    model = zoo.apply(tiny(), "replora", target="q_proj")
    with pytest.raises(ValueError, match="already carries a replora adapter"):
        zoo.apply(model, "mixture-of-loras", target="q_proj,v_proj")
    assert not mixture_modules(model)


@pytest.mark.parametrize("name, options", [
    ("mixture-of-loras", {"router": "remix", "num_loras": 3, "r": 2, "num_samples": 3}),
    ("mixture-of-loras", {"router": "learned", "num_loras": 3, "r": 2, "target": "q_proj,o_proj"}),
    ("replora", {"r": 2, "hidden": 8}),
])
def test_save_and_reload_give_identical_logits_and_keep_the_recipe(tmp_path, name, options):
    model = zoo.apply(tiny(), name, **options)
    randomize(model)
    model.eval()
    # The same weights, bit for bit; logits equal up to float rounding (the reloaded weights are mmapped at
    # unaligned addresses, where the CPU GEMM of the small MLPs takes another SIMD path: ~1e-5 on a logit).
    assert reload_max_diff(model, IDS, tmp_path) < 1e-4
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    state = again.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert again.config.zoo_recipe[-1]["name"] == name and again.config.zoo_recipe[-1]["options"] == options
    cls = RepLoraLinear if name == "replora" else MixtureOfLorasLinear
    kinds = {n: type(m) for n, m in again.named_modules() if isinstance(m, cls)}
    assert kinds.keys() == model.config.zoo_modules.keys() and kinds


def test_remix_moe_router_round_trips(tmp_path):
    model = zoo.apply(tiny(), "remix", num_samples=5)
    model.eval()
    assert reload_max_diff(model, IDS, tmp_path) == 0.0
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(isinstance(m.router, Remix) and m.router.num_samples == 5 for _, m in moe_layers(again))


@pytest.mark.parametrize("router", ["remix", "learned"])
def test_a_few_training_steps_lower_the_loss_and_train_the_router(router):
    torch.manual_seed(0)
    model = zoo.apply(tiny(), "mixture-of-loras", num_loras=4, r=4, router=router, num_samples=3)
    adapter = MixtureOfLoras(num_loras=4, r=4, router=router, num_samples=3)
    routers = [m.router.weight.detach().clone() for _, m in mixture_modules(model)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(12):
        loss, lm = adapter.loss(model, IDS, MASK)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(lm.item())
    assert losses[-1] < losses[0] - 0.1, losses
    moved = [not torch.equal(m.router.weight, w) for (_, m), w in zip(mixture_modules(model), routers)]
    assert all(moved)


# --- replora -------------------------------------------------------------------------------------------------

def test_replora_forward_matches_naive_and_gradients_reach_the_mlps():
    torch.manual_seed(0)
    module = RepLoraLinear(nn.Linear(12, 10), r=3, alpha=6.0, hidden=7)
    x = torch.randn(2, 4, 12)
    assert torch.equal(module(x), F.linear(x, module.weight, module.bias))  # B = 0 at init
    nn.init.normal_(module.mlp_B[2].weight, std=0.3)

    def naive(x):
        mlp = lambda seq, v: seq[2].weight @ F.gelu(seq[0].weight @ v + seq[0].bias) + seq[2].bias
        A = torch.stack([mlp(module.mlp_A, module.input_A[j]) for j in range(3)])  # [r, in]
        B = torch.stack([mlp(module.mlp_B, module.input_B[j]) for j in range(3)], dim=1)  # [out, r]
        return torch.stack([module.weight @ xt + module.bias + module.scale * B @ (A @ xt)
                            for xt in x.reshape(-1, 12)]).view(2, 4, 10)

    trainable = [p for p in module.parameters() if p is not module.weight and p is not module.bias]
    got, want = module(x), naive(x)
    assert torch.allclose(got, want, atol=1e-5)
    g1 = torch.autograd.grad((got ** 2).sum(), trainable)
    g2 = torch.autograd.grad((want ** 2).sum(), trainable)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2))
    assert all(g.abs().max() > 0 for g in g1)  # inputs and both MLPs learn


def test_replora_trains_then_merges_into_plain_linears(tmp_path):
    torch.manual_seed(0)
    model = zoo.apply(tiny(), "replora", r=4, hidden=16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    losses = []
    for _ in range(10):
        loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS.masked_fill(MASK == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
    RepLora().merge(model)
    assert not any(isinstance(m, RepLoraLinear) for m in model.modules()) and model.config.zoo_modules == {}
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    with torch.no_grad():
        assert torch.allclose(model(input_ids=IDS).logits, ref, atol=1e-4)
    assert model.config.zoo_recipe[-1]["options"] == {"merge": True}
    assert reload_max_diff(model, IDS, tmp_path) < 1e-4
