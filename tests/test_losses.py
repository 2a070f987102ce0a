"""Auxiliary MoE losses: Switch balance loss and router z-loss, with padding excluded."""
import pytest
import torch

from zoo.moe import load_balancing_loss, model_load_balancing_loss, z_loss


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def ref_balance(logits, k, mask=None):
    """E * sum_e f_e * P_e over real tokens, written out token by token."""
    num_experts = logits.shape[-1]
    mask = torch.ones(logits.shape[0]) if mask is None else mask.reshape(-1).float()
    f = torch.zeros(num_experts, dtype=torch.float64)
    p = torch.zeros(num_experts, dtype=torch.float64)
    n = 0
    for row, m in zip(logits.double(), mask):
        if not m:
            continue
        n += 1
        probs = torch.exp(row) / torch.exp(row).sum()
        for e in torch.argsort(probs, descending=True)[:k]:
            f[e] += 1.0 / k
        p += probs
    return num_experts * float((f / n * p / n).sum())


def cyclic_logits(num_experts, repeats=3):
    """Each token's logits are a rotation of one distinct-valued vector: every expert is chosen equally
    often for any k, and the mean probability of every expert is exactly 1/E."""
    base = torch.linspace(2.0, -1.0, num_experts)
    return torch.stack([base.roll(t) for t in range(num_experts * repeats)])


@pytest.mark.parametrize("num_experts,k", [(4, 1), (4, 2), (8, 1), (8, 2), (8, 3)])
def test_balance_loss_is_one_for_uniform_balanced_routing(num_experts, k):
    logits = cyclic_logits(num_experts)
    chosen = logits.topk(k, -1).indices.flatten().bincount(minlength=num_experts)
    assert (chosen == chosen[0]).all()  # balanced assignment
    torch.testing.assert_close(logits.softmax(-1).mean(0), torch.full((num_experts,), 1 / num_experts))
    torch.testing.assert_close(load_balancing_loss(logits, k), torch.tensor(1.0))
    # identical logits everywhere: probabilities are uniform, so the loss is 1 whatever top-k picks
    torch.testing.assert_close(load_balancing_loss(torch.zeros(10, num_experts), k), torch.tensor(1.0))


@pytest.mark.parametrize("num_experts,k", [(4, 1), (8, 1), (8, 2)])
def test_balance_loss_grows_when_routing_collapses(num_experts, k):
    balanced = load_balancing_loss(cyclic_logits(num_experts), k)
    partial = torch.randn(32, num_experts)
    partial[:, 0] += 2.0  # expert 0 favoured
    collapsed = torch.randn(32, num_experts)
    collapsed[:, :k] += 30.0  # every token goes to experts 0..k-1 with probability ~1
    partial_loss, collapsed_loss = load_balancing_loss(partial, k), load_balancing_loss(collapsed, k)
    assert balanced < partial_loss < collapsed_loss
    # fully collapsed: f = P = 1/k on k experts, so the loss is E/k (its maximum)
    torch.testing.assert_close(collapsed_loss, torch.tensor(num_experts / k), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_balance_loss_matches_reference(k):
    torch.manual_seed(k)
    logits = torch.randn(25, 6) * 2
    mask = (torch.rand(25) > 0.3).long()
    assert mask.sum() not in (0, 25)
    torch.testing.assert_close(load_balancing_loss(logits, k).item(), ref_balance(logits, k), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(load_balancing_loss(logits, k, mask).item(), ref_balance(logits, k, mask),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["balance", "z"])
def test_padding_tokens_do_not_count(loss):
    torch.manual_seed(4)
    fn = (lambda lg, m=None: load_balancing_loss(lg, 2, m)) if loss == "balance" else z_loss
    real = torch.randn(2, 6, 8)  # [B, S, E] flattened below like the model's router logits
    mask = torch.ones(2, 6, dtype=torch.long)
    base = fn(real.reshape(-1, 8), mask)
    torch.testing.assert_close(base, fn(real.reshape(-1, 8)))  # all-ones mask == no mask

    # right-pad each sequence with 4 tokens whose logits are arbitrary (huge, all on expert 0)
    pad_logits = torch.randn(2, 4, 8) * 50
    pad_logits[..., 0] += 100
    padded = torch.cat([real, pad_logits], 1).reshape(-1, 8)
    padded_mask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.long)], 1)
    torch.testing.assert_close(fn(padded, padded_mask), base, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fn(padded, padded_mask.bool()), base, rtol=1e-6, atol=1e-6)
    # without the mask the padding does count (so the test above can fail)
    assert not torch.allclose(fn(padded), base, rtol=1e-3)


@pytest.mark.parametrize("loss", ["balance", "z"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_padding_logits_do_not_count(loss, bad):
    torch.manual_seed(11)
    fn = (lambda lg, m: load_balancing_loss(lg, 2, m)) if loss == "balance" else z_loss
    real = torch.randn(6, 4)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0])
    logits = torch.cat([real, torch.full((2, 4), bad)]).requires_grad_()
    value = fn(logits, mask)
    torch.testing.assert_close(value, fn(real, None))
    value.backward()
    assert torch.isfinite(logits.grad).all() and torch.count_nonzero(logits.grad[6:]) == 0


def test_all_padding_gives_zero_not_nan():
    logits = torch.randn(5, 4)
    mask = torch.zeros(5)
    assert load_balancing_loss(logits, 2, mask).item() == 0.0
    assert z_loss(logits, mask).item() == 0.0


def test_mask_size_mismatch_raises():
    with pytest.raises(ValueError, match="attention_mask"):
        load_balancing_loss(torch.randn(6, 4), 1, torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_mask"):
        z_loss(torch.randn(6, 4), torch.ones(7))


def test_z_loss_matches_formula():
    torch.manual_seed(5)
    logits = torch.randn(12, 8) * 3
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1])
    expected = sum(float(torch.log(torch.exp(row.double()).sum())) ** 2
                   for row, m in zip(logits, mask) if m) / int(mask.sum())
    torch.testing.assert_close(z_loss(logits, mask).item(), expected, rtol=1e-5, atol=0)
    unmasked = sum(float(torch.log(torch.exp(row.double()).sum())) ** 2 for row in logits) / 12
    torch.testing.assert_close(z_loss(logits).item(), unmasked, rtol=1e-5, atol=0)
    # large logits do not overflow (logsumexp, not log(sum(exp)))
    big = torch.full((2, 4), 200.0)
    torch.testing.assert_close(z_loss(big), torch.tensor((200.0 + torch.log(torch.tensor(4.0)).item()) ** 2))


def test_losses_of_bf16_logits_are_computed_in_fp32():
    torch.manual_seed(6)
    logits = torch.randn(16, 8)
    low = logits.to(torch.bfloat16)
    for fn in (lambda lg: load_balancing_loss(lg, 2), z_loss):
        out = fn(low)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, fn(low.float()))


def test_balance_loss_gradient():
    torch.manual_seed(7)
    num_experts, k = 6, 2
    logits = (torch.randn(10, num_experts) * 2).requires_grad_()
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1, 1, 1])
    load_balancing_loss(logits, k, mask).backward()
    # f is a count (no gradient); P_e = mean_t softmax_t[e], so dL/dlogits_t = E/N * p_t * (f - p_t . f)
    with torch.no_grad():
        p = logits.softmax(-1)
        real = mask.bool()
        n = int(real.sum())
        f = torch.zeros(num_experts)
        for row in p[real]:
            f[row.topk(k).indices] += 1.0 / (k * n)
        expected = num_experts / n * p * (f - (p * f).sum(-1, keepdim=True))
        expected[~real] = 0
    assert logits.grad is not None and torch.count_nonzero(logits.grad[mask.bool()]) > 0
    assert torch.count_nonzero(logits.grad[~mask.bool()]) == 0  # padding gets exactly nothing
    torch.testing.assert_close(logits.grad, expected)


def test_z_loss_gradient():
    torch.manual_seed(8)
    logits = (torch.randn(9, 5) * 2).requires_grad_()
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 1])
    z_loss(logits, mask).backward()
    with torch.no_grad():
        expected = 2 * torch.logsumexp(logits, -1, keepdim=True) * logits.softmax(-1) / int(mask.sum())
        expected[~mask.bool()] = 0
    assert torch.count_nonzero(logits.grad[~mask.bool()]) == 0
    torch.testing.assert_close(logits.grad, expected)


def test_gradients_reach_a_router_through_the_logits():
    from zoo_routers.topk_softmax import TopKSoftmax

    torch.manual_seed(9)
    router = TopKSoftmax(8, 4, 2)
    routing = router(torch.randn(6, 8))
    (load_balancing_loss(routing.logits, 2) + 1e-3 * z_loss(routing.logits)).backward()
    assert router.weight.grad is not None and torch.count_nonzero(router.weight.grad) > 0


def test_model_balance_loss_is_the_mean_over_layers():
    torch.manual_seed(10)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # [B, S]; layers see [B*S, E] logits
    layers = [torch.randn(8, 4), torch.randn(8, 8), torch.randn(8, 6)]  # experts and k differ per layer
    ks = [1, 2, 3]
    expected = sum(ref_balance(lg, k, mask) for lg, k in zip(layers, ks)) / 3
    torch.testing.assert_close(model_load_balancing_loss(layers, ks, mask).item(), expected, rtol=1e-5, atol=1e-6)
    # padding changes nothing at the model level either
    noisy = [lg.clone() for lg in layers]
    for lg in noisy:
        lg[~mask.reshape(-1).bool()] = torch.randn(3, lg.shape[1]) * 40
    torch.testing.assert_close(model_load_balancing_loss(noisy, ks, mask), model_load_balancing_loss(layers, ks, mask))
