"""roma: router-only post-training with RoMA's manifold regulariser. The penalty and the neighbour search against
loops over samples and neighbours (values and gradients), the routing profile against one sample at a time, only
the routers train, the regulariser pulls toward the successful neighbours, save/reload, the shipped embedding."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.testing import tiny_model
from zoo_adapters.roma import Roma
from zoo_adapters.roma_embed import wordllama_embed
from zoo_adapters.roma_manifold import (capture_routing, ids_key, manifold_penalty, manifold_penalty_reference,
                                        neighbours, routing_profile)

pytestmark = pytest.mark.usefixtures("one_thread")


def samples(seed=0, n=6, seq=12):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(3, 40, (n, seq), generator=g), "b": torch.randint(30, 64, (n, seq), generator=g)}


@pytest.fixture
def tuned():
    """A tiny Mixtral with roma attached and its pool recorded (the model's own hidden state as the embedding)."""
    roma = Roma(lam=1.0, k=3, embedding="hidden")
    model = zoo.apply(tiny_model("mixtral"), "roma", lam=1.0, k=3, embedding="hidden")
    roma.bank(model, samples())
    return model, roma


def test_penalty_matches_the_loop_over_samples_and_neighbours_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    profiles = torch.rand(5, 12, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.rand(9, 12, generator=g, dtype=torch.float64).requires_grad_()
    idx = torch.randint(0, 9, (5, 4), generator=g)
    weights = torch.rand(5, 4, generator=g, dtype=torch.float64)
    fast = manifold_penalty(profiles, targets, idx, weights)
    (grad_fast,) = torch.autograd.grad(fast, profiles)
    slow = manifold_penalty_reference(profiles, targets, idx, weights)
    (grad_slow,) = torch.autograd.grad(slow, profiles)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(grad_fast, grad_slow)
    # by hand for sample 0: the gradient of W ||r - t||^2 is 2 W (r - t); the neighbours' profiles get none
    by_hand = sum(2 * weights[0, j] * (profiles[0] - targets[idx[0, j]]) for j in range(4)) / 5
    torch.testing.assert_close(grad_fast[0], by_hand.detach())
    assert torch.autograd.grad(manifold_penalty(profiles, targets, idx, weights), targets, allow_unused=True)[0] is None


def test_neighbours_are_the_nearest_by_cosine_with_heat_kernel_weights_and_never_the_sample_itself():
    g = torch.Generator().manual_seed(2)
    cands = torch.nn.functional.normalize(torch.randn(10, 6, generator=g), dim=-1)
    queries = torch.cat([cands[:2], torch.nn.functional.normalize(torch.randn(2, 6, generator=g), dim=-1)])
    exclude = torch.zeros(4, 10, dtype=torch.bool)
    exclude[0, 0] = exclude[1, 1] = True  # queries 0 and 1 are bank samples 0 and 1
    idx, w = neighbours(queries, cands, 3, 0.5, exclude)
    for i in range(4):
        allowed = [j for j in range(10) if not exclude[i, j]]
        dist = {j: float(((queries[i] - cands[j]) ** 2).sum()) for j in allowed}
        nearest = sorted(allowed, key=dist.get)[:3]
        assert idx[i].tolist() == nearest
        torch.testing.assert_close(w[i], torch.tensor([torch.exp(torch.tensor(-dist[j] / 0.5)) for j in nearest]))
    assert 0 not in idx[0].tolist() and 1 not in idx[1].tolist()
    few, wf = neighbours(queries[:1], cands[:2], 5, 1.0, torch.tensor([[True, False]]))
    assert few.shape == (1, 2) and wf[0, few[0].tolist().index(0)] == 0  # fewer allowed than k: weight 0


def test_routing_profile_of_a_padded_batch_is_each_sample_alone():
    model = zoo.convert(tiny_model("mixtral"))
    blocks = dict(Roma().tuned(model))
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    with torch.no_grad(), capture_routing(blocks) as probs:
        model(input_ids=ids, attention_mask=mask)
    batch = routing_profile(probs, 2, 10, mask)
    for i, n in ((0, 10), (1, 6)):
        with torch.no_grad(), capture_routing(blocks) as probs:
            model(input_ids=ids[i:i + 1, :n])
        by_hand = torch.cat([probs[layer][0].mean(0) for layer in sorted(blocks)])  # mean over its own tokens
        torch.testing.assert_close(batch[i], by_hand, atol=1e-5, rtol=1e-5)
    assert batch.shape == (2, len(blocks) * 4)


def test_only_the_tuned_routers_train(tuned):
    model, roma = tuned
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.mlp.router.weight" for i in range(2)}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    loss, lm = roma.loss(model, samples(5)["a"])
    assert loss > lm and roma.last_penalty > 0
    loss.backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"model.layers.{i}.mlp.router.weight" for i in range(2)}
    last = zoo.apply(tiny_model("mixtral"), "roma", last_layers=1, embedding="hidden")
    assert {n for n, p in last.named_parameters() if p.requires_grad} == {"model.layers.1.mlp.router.weight"}


def test_the_regulariser_pulls_routing_toward_the_successful_neighbours(tuned):
    model, roma = tuned
    batch = samples(7)["b"]
    bank = roma.bank(model)
    assert 0 < int(bank.successful.sum()) < len(bank.keys)  # the top half by next-token accuracy
    plain = copy.deepcopy(model)
    lam0 = Roma(lam=0.0, k=3, embedding="hidden")
    lam0.bank(plain, samples())
    loss0, lm0 = lam0.loss(plain, batch)
    assert torch.equal(loss0, lm0) and torch.allclose(lm0, roma.loss(model, batch)[1])  # lam=0: the LM loss alone
    strong = Roma(lam=1000.0, k=3, embedding="hidden")  # the penalty dominates: it must fall
    strong.bank(model, samples())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=0.05)
    first = None
    for _ in range(15):
        loss, _ = strong.loss(model, batch)
        first = float(strong.last_penalty) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    strong.loss(model, batch)
    assert float(strong.last_penalty) < 0.5 * first


def test_a_sample_of_the_pool_is_not_its_own_neighbour(tuned):
    model, roma = tuned
    bank = roma.bank(model)
    _, _, keys = bank.successes()
    member = samples()["a"][bank.successful[:6].nonzero()[0]]
    assert ids_key(member[0]) in keys
    roma.k = 50  # every successful sample but itself
    roma.loss(model, member)
    alone = float(roma.last_penalty)
    roma.bank(model).successful[:] = False
    roma.bank(model).successful[bank.keys.index(ids_key(member[0]))] = True  # only itself is left: no neighbour
    roma.loss(model, member)
    assert alone > 0 and float(roma.last_penalty) == 0.0


def test_trained_routers_save_and_reload(tuned, tmp_path):
    model, roma = tuned
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for step in range(2):
        loss, _ = roma.loss(model, samples(10 + step)["a"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    ids = samples(20)["b"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, expected)
    steps = [s for s in again.config.zoo_recipe if s["name"] == "roma"]
    assert steps and steps[0]["options"]["embedding"] == "hidden"


def test_bad_options_refused_before_the_model_changes():
    model = zoo.convert(tiny_model("mixtral"))
    with pytest.raises(ValueError, match="did you mean 'wordllama'"):
        zoo.apply(model, "roma", embedding="wordlama")
    with pytest.raises(ValueError, match="success"):
        zoo.apply(model, "roma", success=1.5)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(TypeError, match="not a supported MoE family|MoE"):
        zoo.apply(tiny_model("mistral"), "roma")


def test_the_shipped_sentence_embedding_tells_code_from_english_offline():
    texts = ["def add(a, b):\n    return a + b", "for i in range(10):\n    print(i)",
             "Shall I compare thee to a summer's day?", "My lord, the queen is dead."]
    e = wordllama_embed(texts)
    sim = e @ e.T
    assert e.shape == (4, 256) and torch.allclose(sim.diagonal(), torch.ones(4), atol=1e-4)
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3]) and sim[2, 3] > max(sim[2, 0], sim[2, 1])
