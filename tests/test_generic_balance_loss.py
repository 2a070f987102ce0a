"""The balance loss of converted models, for families that keep their own forward (the generic adapter's) and for
first-party ones: the family's own loss, bit for bit, while every MoE layer has the same expert count; the mean
of the per-layer losses (each over its own experts) once a prune or merge makes them differ; and a training step
through it."""
import pytest
import torch

import zoo
from tests.families.test_generic_families import input_ids, native_model
from zoo.moe.layout import moe_layers, set_block
from zoo.moe.surgery import keep_experts

# routers of different kinds: softmax top-k, sigmoid with selection bias, sparsemixer, a vision-language model
# (hybrid attention), and a first-party family (the zoo's own causal-LM forward)
UNIFORM = ["granitemoe", "minimax_m2", "phimoe", "qwen3_5_moe", "glm4v_moe", "mixtral"]
TWO_MOE_LAYERS = ["granitemoe", "minimax_m2", "qwen3_5_moe", "mixtral"]


def batch(model):
    ids = input_ids(model)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: padded tokens must not count
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def per_layer_by_hand(router_logits, top_ks, mask) -> torch.Tensor:
    """Mean over layers of ``E_l * sum_e f_e P_e``: f_e the share of real tokens choosing expert e among their
    top k, P_e its mean router probability over real tokens."""
    m = mask.reshape(-1).float()
    losses = []
    for logits, k in zip(router_logits, top_ks):
        probs = logits.float().softmax(-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
        f = (chosen * m[:, None]).sum(0) / m.sum()
        p = (probs * m[:, None]).sum(0) / m.sum()
        losses.append(logits.shape[-1] * (f * p).sum())
    return torch.stack(losses).mean()


def coefficient(model) -> float:
    return model.config.get_text_config().router_aux_loss_coef


@pytest.mark.parametrize("model_type", UNIFORM)
def test_uniform_layout_is_the_familys_own_loss(model_type):
    native = native_model(model_type)
    inputs = batch(native)
    want = native(**inputs, output_router_logits=True)
    model = zoo.convert(native)
    got = model(**inputs, output_router_logits=True)
    # the converted blocks compute what the family's do up to float rounding (conversion holds 1e-5 on logits)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-6)
    assert len(got.router_logits) == len(want.router_logits)
    for mine, theirs in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", TWO_MOE_LAYERS)
def test_layers_of_different_expert_counts_give_the_per_layer_loss(model_type):
    model = zoo.convert(native_model(model_type))
    inputs = batch(model)
    model(**inputs, output_router_logits=True)  # transformers hooks the routers present now, not those swapped in
    (i, moe), (_, other) = moe_layers(model)[:2]
    set_block(model, i, keep_experts(moe, range(moe.num_experts - 1)))
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
        plain = model(**inputs, output_router_logits=False)
    assert [lg.shape[-1] for lg in out.router_logits] == [moe.num_experts - 1, other.num_experts]
    want = per_layer_by_hand(out.router_logits, [moe.top_k, other.top_k], inputs["attention_mask"])
    torch.testing.assert_close(out.aux_loss, want, rtol=0, atol=1e-6)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + coefficient(model) * want, rtol=0, atol=1e-6)
    assert torch.equal(out.logits, plain.logits)


def test_a_calibrated_prune_after_a_forward_keeps_the_loss():
    model = zoo.convert(native_model("granitemoe"))
    inputs = batch(model)
    model(**inputs, output_router_logits=True)
    zoo.apply(model, "prune-frequency", calibration=[input_ids(model, rows=4, length=16)], num_experts=3,
              allocation="global")
    counts = [moe.num_experts for _, moe in moe_layers(model)]
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
    assert [lg.shape[-1] for lg in out.router_logits] == counts
    want = per_layer_by_hand(out.router_logits, [moe.top_k for _, moe in moe_layers(model)], inputs["attention_mask"])
    if len(set(counts)) == 1:  # uniform: the family's pooling over layers, not the per-layer mean
        from transformers.models.granitemoe.modeling_granitemoe import load_balancing_loss_func

        want = load_balancing_loss_func(out.router_logits, counts[0], 2, inputs["attention_mask"])
    torch.testing.assert_close(out.aux_loss, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", ["minimax_m2", "mixtral"])
def test_a_training_step_through_the_balance_loss(model_type):
    model = zoo.convert(native_model(model_type)).train()
    inputs = batch(model)
    (i, moe), (_, other) = moe_layers(model)[:2]
    set_block(model, i, keep_experts(moe, range(moe.num_experts - 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = model(**inputs, output_router_logits=True)
    out.loss.backward()  # the label loss plus the family's coefficient times the per-layer balance loss
    grads = [moe.router.weight.grad for _, moe in moe_layers(model)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    optimizer.step()
    with torch.no_grad():
        after = model(**inputs, output_router_logits=True)
    assert torch.isfinite(after.aux_loss) and after.loss < out.loss


def test_the_familys_arguments_and_tuples_stay():
    import inspect

    model = zoo.convert(native_model("granitemoe"))
    assert {"labels", "attention_mask", "logits_to_keep", "output_router_logits"} <= set(
        inspect.signature(model.forward).parameters)
    inputs = batch(model)
    out = model(**inputs, output_router_logits=True)
    as_tuple = model(**inputs, output_router_logits=True, return_dict=False)
    assert torch.equal(as_tuple[0], out.loss) and torch.equal(as_tuple[1], out.aux_loss)
