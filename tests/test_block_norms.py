"""The MoE block's norms (``SparseMoE.input_norm`` / ``output_norm``, ``zoo.moe.norms``): each style against the
family norm it stands for, the block against a naive reference (outputs and gradients), the layout round trip and
its checks, and the calibration statistics reading what the experts read."""
import pytest
import torch
from transformers.models.axk1.modeling_axk1 import AXK1RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.muse_spark.modeling_muse_spark import (MuseSparkTextCenteredRMSNorm,
                                                                MuseSparkTextInputScaledRMSNorm)

from zoo.editing.stats import layer_stats
from zoo.moe import SharedMLP, SparseMoE, SwiGLUExperts
from zoo.moe.layout import LayoutError, build_block, check_layout
from zoo.moe.norms import BlockRMSNorm, as_block_norm
from zoo_routers.topk_softmax import TopKSoftmax

H = 16


def randomised(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return module


@pytest.mark.parametrize("native, style", [(AXK1RMSNorm(H, eps=1e-6), "weight-after-cast"),
                                           (Gemma4RMSNorm(H, eps=1e-5), "weight-in-fp32"),
                                           (Gemma3RMSNorm(H, eps=1e-6), "offset"),
                                           (MuseSparkTextCenteredRMSNorm(H, eps=1e-5), "offset-in-dtype"),
                                           (MuseSparkTextInputScaledRMSNorm(H, eps=1e-8), "input-offset")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_style_is_the_family_norm_it_stands_for(native, style, dtype):
    options = as_block_norm(native, H)
    assert options == {"hidden_size": H, "eps": native.variance_epsilon if hasattr(native, "variance_epsilon")
                       else native.eps, "style": style}
    native = randomised(native).to(dtype)
    ours = BlockRMSNorm(**options).to(dtype)
    ours.load_state_dict(native.state_dict())
    x = (torch.randn(32, H, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    if dtype is torch.float32:
        torch.testing.assert_close(ours(x), native(x), rtol=1e-6, atol=1e-6)
    elif style == "weight-in-fp32":  # Gemma 4 takes x**-0.5 with pow, ours with rsqrt: a last-bit flip at most
        assert (ours(x) != native(x)).float().mean() <= 0.02
    else:  # the same rounding steps: bit for bit in bf16
        assert torch.equal(ours(x), native(x))


def test_a_module_that_is_not_an_rms_norm_is_not_taken_for_one():
    assert as_block_norm(torch.nn.LayerNorm(H), H) is None  # weight and bias
    assert as_block_norm(torch.nn.Linear(H, H, bias=False), H) is None
    assert as_block_norm(AXK1RMSNorm(H + 1), H) is None
    with pytest.raises(ValueError, match="unknown RMS norm style 'gemma'; choose from"):
        BlockRMSNorm(H, style="gemma")


def block(input_norm=False, output_norm=False, shared=True, seed=0):
    torch.manual_seed(seed)
    experts = SwiGLUExperts(6, H, 32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    norms = {"input_norm": randomised(BlockRMSNorm(H, 1e-6, "weight-in-fp32"), 1) if input_norm else None,
             "output_norm": randomised(BlockRMSNorm(H, 1e-6), 2) if output_norm else None}
    return SparseMoE(TopKSoftmax(H, 6, 2), experts, SharedMLP(H, 24) if shared else None, **norms)


def naive(moe, x):
    """Router and shared experts on the block's input, routed experts on its normed copy, norm on the sum."""
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    w, idx = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    xe = x if moe.input_norm is None else moe.input_norm(x)
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = idx[t, j]
            gate, up = (ex.gate_up_proj[e] @ xe[t]).chunk(2)
            out[t] += w[t, j] * (ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out if moe.output_norm is None else moe.output_norm(out)


@pytest.mark.parametrize("input_norm, output_norm", [(True, False), (False, True), (True, True)])
def test_block_with_norms_matches_the_naive_reference_outputs_and_gradients(input_norm, output_norm):
    moe = block(input_norm, output_norm)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    got = moe(x[None])[0]
    want = naive(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(got)
    grads = torch.autograd.grad((got * probe).sum(), [x, *moe.parameters()])
    wants = torch.autograd.grad((want * probe).sum(), [x, *moe.parameters()], allow_unused=True)
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-4, atol=1e-6)


def test_norms_travel_in_the_layout_and_through_with_parts():
    moe = block(True, True)
    entry = moe.layout()
    assert entry["input_norm"] == {"hidden_size": H, "eps": 1e-6, "style": "weight-in-fp32"}
    assert entry["output_norm"]["style"] == "weight-after-cast"
    rebuilt = build_block(entry)
    rebuilt.load_state_dict(moe.state_dict())
    x = torch.randn(1, 5, H)
    torch.testing.assert_close(rebuilt(x), moe(x))
    swapped = moe.with_parts(router=TopKSoftmax(H, 6, 1))
    assert swapped.input_norm is moe.input_norm and swapped.output_norm is moe.output_norm
    assert "input_norm" not in block().layout() and "output_norm" not in block().layout()


def test_a_layout_with_a_bad_norm_names_the_entry_and_the_part():
    entry = block(True, True).layout()
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.input_norm: unknown RMS norm style"):
        check_layout([{**entry, "input_norm": {**entry["input_norm"], "style": "nope"}}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.output_norm\.hidden_size: 8, but the model's "):
        check_layout([{**entry, "output_norm": {**entry["output_norm"], "hidden_size": 8}}], 1, H)


def test_statistics_run_the_experts_on_what_they_read():
    """REAP's saliency of a block with an input norm: gate * ||f_e(norm(x))||, routed on x."""
    moe = block(True, False, shared=False)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4)) * 3
    st = layer_stats(0, moe, x)
    routing = moe.route(x)
    xe = moe.input_norm(x)
    want = torch.zeros(6, dtype=torch.float64)
    for e in range(6):
        tok, slot = (routing.indices == e).nonzero(as_tuple=True)
        if len(tok):
            out = moe.experts.expert(e, xe[tok]).double()
            want[e] = (routing.weights[tok, slot].double() * out.norm(dim=-1)).mean()
    torch.testing.assert_close(st.reap, want)
