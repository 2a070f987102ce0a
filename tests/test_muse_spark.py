"""Muse Spark and the zoo's latent block (``input_proj`` -> ``input_norm`` -> experts -> ``expert_output_norm`` ->
weight -> ``output_proj``): the block against a naive reference (outputs and gradients), its layout recorded, rebuilt
and refused when its widths disagree, REAP statistics read through the output norm and projection, the
``logit_scale`` of ``scored-topk``, and the tiny Muse Spark (vision-language, latent experts half the model's width)
converted losslessly, reloaded, exported bit for bit and changed by the zoo's components."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, MuseSparkForConditionalGeneration

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel, reload_and_export_bit_for_bit
from tests.families.test_generic_families import native_model
from zoo.components.registry import registry
from zoo.editing.stats import layer_stats
from zoo.moe import SharedMLP, SparseMoE, SwiGLUExperts
from zoo.moe.block_parts import BlockLinear
from zoo.moe.layout import LayoutError, build_block, check_layout, moe_layers
from zoo.moe.norms import BlockRMSNorm

E, H, M, K = 6, 24, 16, 2
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def scored(**options):
    return registry.get("router", "scored-topk").obj(H, E, K, score="sigmoid", selection_bias=True, **options)


def latent_block(shared=False, seed=0):
    torch.manual_seed(seed)
    moe = SparseMoE(scored(logit_scale=0.25), SwiGLUExperts(E, M, 12), SharedMLP(H, 8) if shared else None,
                    input_proj=BlockLinear(H, M), input_norm=BlockRMSNorm(M, 1e-5, "offset-in-dtype"),
                    expert_output_norm=BlockRMSNorm(M, 1e-8, "input-offset"), output_proj=BlockLinear(M, H))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.router.e_score_correction_bias.normal_(0, 0.3)
    return moe


def naive(moe, x):
    """Token by token: sigmoid of the scaled logits, top-k by score plus bias, renormalised; each chosen expert on
    the projected, normed input; its output normed, weighted, summed, projected back; the shared MLP on x."""
    scores = torch.sigmoid(0.25 * (x @ moe.router.weight.T))
    idx = (scores + moe.router.e_score_correction_bias).topk(K, -1).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    xe = moe.input_norm(x @ moe.input_proj.weight.T)
    ex, rows = moe.experts, []
    for t in range(x.shape[0]):
        row = torch.zeros(M)
        for j in range(K):
            gate, up = (ex.gate_up_proj[idx[t, j]] @ xe[t]).chunk(2)
            y = ex.down_proj[idx[t, j]] @ (torch.nn.functional.silu(gate) * up)
            row = row + w[t, j] * moe.expert_output_norm(y[None])[0]
        rows.append(row @ moe.output_proj.weight.T)
    out = torch.stack(rows)
    return out if moe.shared_experts is None else out + moe.shared_experts(x)


@pytest.mark.parametrize("shared", [False, True])
def test_latent_block_matches_the_naive_reference_outputs_and_gradients(shared):
    moe = latent_block(shared)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    got, want = moe(x[None])[0], naive(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(got)
    params = [p for p in moe.parameters() if p.requires_grad]
    grads = torch.autograd.grad((got * probe).sum(), [x, *params])
    wants = torch.autograd.grad((want * probe).sum(), [x, *params], allow_unused=True)
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-4, atol=1e-5)


def test_latent_block_layout_round_trip_and_refusals():
    moe = latent_block()
    entry = moe.layout()
    assert entry["router_options"]["logit_scale"] == 0.25 and entry["experts_options"]["hidden_size"] == M
    assert entry["input_proj"] == {"in_features": H, "out_features": M}
    rebuilt = build_block(entry)
    rebuilt.load_state_dict(moe.state_dict())
    x = torch.randn(1, 5, H)
    torch.testing.assert_close(rebuilt(x), moe(x))
    swapped = moe.with_parts(router=scored())
    assert all(swapped.parts()[n] is p for n, p in moe.parts().items())
    assert "logit_scale" not in scored().options  # at its default it stays out of the layout
    check_layout([entry], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.input_proj: a latent block needs both"):
        check_layout([{k: v for k, v in entry.items() if k != "output_proj"}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.experts_options\.hidden_size: 16, but the model's "
                                          r"hidden_size is 24 \(experts of another width need input_proj"):
        check_layout([{k: v for k, v in entry.items() if k not in ("input_proj", "output_proj")}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.input_norm\.hidden_size: 24, but the experts' "
                                          r"hidden_size is 16"):
        check_layout([{**entry, "input_norm": {**entry["input_norm"], "hidden_size": H}}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.output_proj: 16 -> 32, but it must be 16 -> 24"):
        check_layout([{**entry, "output_proj": {"in_features": M, "out_features": 32}}], 1, H)
    with pytest.raises(ValueError, match="logit_scale must be a positive finite number"):
        scored(logit_scale=0.0)


def test_statistics_read_what_an_expert_adds_to_the_model():
    """REAP's saliency of a latent block: gate * ||output_proj(expert_output_norm(f_e(input_norm(input_proj x))))||."""
    moe = latent_block()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4)) * 3
    with torch.no_grad():
        st = layer_stats(0, moe, x, all_outputs=True)
        routing, xe = moe.route(x), moe.expert_inputs(x)
        want, mean = torch.zeros(E, dtype=torch.float64), torch.zeros(E, H, dtype=torch.float64)
        for e in range(E):
            out = (moe.expert_output_norm(moe.experts.expert(e, xe)) @ moe.output_proj.weight.T).double()
            mean[e] = out.mean(0)
            tok, slot = (routing.indices == e).nonzero(as_tuple=True)
            if len(tok):
                want[e] = (routing.weights[tok, slot].double() * out[tok].norm(dim=-1)).mean()
    torch.testing.assert_close(st.reap, want)
    torch.testing.assert_close(st.mean_output, mean)


def native():
    model = native_model("muse_spark")
    with torch.no_grad():  # the family initialises the norms' offsets and the bias to zero: make them count
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.pre_expert_norm.weight.normal_(std=0.3)
                layer.mlp.experts.post_expert_norm.weight.normal_(std=0.3)
                layer.mlp.gate.e_score_correction_bias.normal_(std=0.3)
    return model


def logits(model):
    return logits_of(model, IDS)


def test_converts_losslessly_reloads_and_exports_bit_for_bit(tmp_path):
    model = native()
    want, want_tokens, want_state = logits(model), greedy_of(model, IDS, 4), dict(model.state_dict())
    model = zoo.convert(model)
    (_, moe), = moe_layers(model)
    assert moe.experts.hidden_size == model.config.text_config.moe_hidden_size < model.config.text_config.hidden_size
    assert moe.layout()["expert_output_norm"]["style"] == "input-offset"
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy_of(model, IDS, 4), want_tokens)
    reload_and_export_bit_for_bit(model, tmp_path, AutoModelForImageTextToText, MuseSparkForConditionalGeneration,
                                  logits, want, want_state)


@pytest.mark.parametrize("method, options", [("prune-reap", {"num_experts": 3}), ("hc-smoe", {"num_experts": 2}),
                                             ("sub-moe", {"num_experts": 2}), ("moe-svd", {"ratio": 0.5})])
def test_calibrated_compressors_carry_the_latent_parts(method, options, tmp_path, one_thread):
    model = zoo.convert(native())
    before = {n: p.clone() for n, p in next(iter(moe_layers(model)))[1].parts().items() if p is not None
              for n, p in [(n, p.weight)]}
    zoo.apply(model, method, calibration=CAL, **options)
    (_, moe), = moe_layers(model)
    assert all(torch.equal(moe.parts()[n].weight, w) for n, w in before.items())
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "changed").eval()
    assert rel(logits(back), out) <= 1e-5
