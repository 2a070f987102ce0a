"""adamoe (AdaMoE, arXiv:2510.14300): the router's softmax top-k selects, an independent linear scale adapter adds
to the chosen experts' weights; ``upcycle`` with ``router="adamoe"`` builds the paper's layer (dense FFN as a
shared expert, averaged with the routed copies). Each against a plain reference."""
import pytest
import torch
import torch.nn.functional as F
from tiny import COMMON, padded_batch, reload_max_diff
from transformers import MistralConfig, MistralForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from zoo.testing import check_reference
from zoo_routers.adamoe import AdaMoE

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_dense(seed=0):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=16)).eval()


def naive_routing(router, x):
    """The paper's equations written out: p = softmax(W_r x), S = TopK(p), w_e = scale * (p_e + (W_s x)_e)."""
    p = torch.softmax(x @ router.weight.T, dim=-1)
    s = x @ router.scale_adapter.T
    idx = p.topk(router.top_k, dim=-1).indices
    return idx, router.routed_scale * (p.gather(1, idx) + s.gather(1, idx))


@pytest.mark.parametrize("top_k, routed_scale", [(1, 1.0), (2, 0.5), (4, 1.0)])
def test_forward_and_gradients_match_the_reference(top_k, routed_scale):
    torch.manual_seed(top_k)
    router = AdaMoE(16, 4, top_k, routed_scale=routed_scale)
    check_reference(router, top_k)  # outputs and gradients (input, gate, scale adapter) against the token loop
    x = torch.randn(9, 16)
    r = router(x)
    idx, w = naive_routing(router, x)
    assert torch.equal(r.indices, idx) and torch.allclose(r.weights, w, atol=1e-6)
    assert torch.allclose(r.logits, x @ router.weight.T)  # the balance loss sees the router alone


def test_selection_ignores_the_scale_adapter_and_weights_follow_it():
    torch.manual_seed(0)
    router = AdaMoE(16, 6, 2)
    x = torch.randn(10, 16)
    before = router(x)
    with torch.no_grad():
        router.scale_adapter.mul_(-5.0).add_(1.0)
    after = router(x)
    assert torch.equal(before.indices, after.indices)  # the adapter never changes which experts run...
    assert not torch.allclose(before.weights, after.weights)  # ...only how much each counts


def test_balance_loss_reaches_the_router_only_and_the_task_loss_both():
    torch.manual_seed(0)
    router = AdaMoE(16, 4, 2)
    x = torch.randn(32, 16)
    r = router(x)
    probs = torch.softmax(r.logits, -1)  # Switch balance loss from the logits, as the families compute it
    load = F.one_hot(r.indices, 4).float().sum((0, 1)) / r.indices.numel()
    (4 * (load * probs.mean(0)).sum()).backward(retain_graph=True)
    assert router.weight.grad.abs().sum() > 0 and router.scale_adapter.grad is None
    router.weight.grad = None
    (r.weights * torch.randn_like(r.weights)).sum().backward()  # a task loss through the weights
    assert router.weight.grad.abs().sum() > 0 and router.scale_adapter.grad.abs().sum() > 0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="routed_scale must be positive"):
        AdaMoE(16, 4, 2, routed_scale=0.0)
    with pytest.raises(ValueError, match="routed_scale"):
        AdaMoE(16, 4, 2, routed_scale=float("nan"))


def test_upcycle_builds_the_papers_layer_and_reloads(tmp_path):
    dense = tiny_dense()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = zoo.apply(dense, "upcycle", num_experts=4, top_k=1, router="adamoe")
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in before.items())  # the dense model is untouched
    assert moe.config.zoo_recipe[-1]["options"]["router"] == "adamoe"
    mlps = [layer.mlp for layer in dense.model.layers]
    for (i, block), mlp in zip(moe_layers(moe), mlps):
        assert isinstance(block.router, AdaMoE) and block.router.routed_scale == 0.5
        assert block.shared_experts.scale == 0.5 and torch.equal(block.shared_experts.down_proj.weight,
                                                                  mlp.down_proj.weight)
        assert not torch.allclose(block.router.scale_adapter, block.router.weight)  # independent draws
        # without noise every routed expert is the dense FFN: out = 0.5 FFN(x) + 0.5 (p + s) FFN(x), written out
        x = torch.randn(7, 64)
        with torch.no_grad():
            _, w = naive_routing(block.router, x)
            ffn = mlp(x)
            want = 0.5 * ffn + w.sum(-1, keepdim=True) * ffn
            assert torch.allclose(block(x[None])[0], want, atol=1e-5)
    assert reload_max_diff(moe, IDS, tmp_path / "m") < 1e-6


def test_an_unknown_router_leaves_the_dense_model_as_it_was():
    dense = tiny_dense()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    with pytest.raises(ValueError, match="router must be one of"):
        zoo.apply(dense, "upcycle", router="adamo")
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in before.items())


def test_one_training_step_moves_router_scale_adapter_and_experts():
    moe = zoo.apply(tiny_dense(), "upcycle", num_experts=4, top_k=2, router="adamoe", noise=0.05).train()
    out = moe(input_ids=IDS, attention_mask=MASK, labels=IDS, output_router_logits=True)
    out.loss.backward()
    block = moe_layers(moe)[0][1]
    for p in (block.router.weight, block.router.scale_adapter, block.experts.gate_up_proj,
              block.shared_experts.up_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
