"""earth-adapter (zoo_multimodal): the band split against an explicit DFT matrix, the mixture of adapters against a
token-by-token reference (outputs and gradients), attach as a no-op that freezes the backbone, the plain-adapter
control, refusals that leave the model bit-identical, save/reload, a few training steps, its card and Space, and
``zoo.testing.check_component``."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.testing import sample_inputs, tiny_model

# isort: split
# (after ``import zoo``: importing a plugin module first would run the plugin hooks on a half-imported module)
from zoo_multimodal.earth_adapter import (
    EarthAdapter,
    EarthAdapterEncoder,
    FrequencyMixture,
    low_mask,
    split_bands,
)
from zoo_multimodal.modeling_zoo_mm import Encoder

pytestmark = pytest.mark.usefixtures("one_thread")


def mm(seed=0):
    return tiny_model("zoo_mm", seed=seed)


def state_bytes(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def randomize(module, std=0.3, seed=1):
    """Give the zero-initialised output layers values, so the adapter changes its input."""
    g = torch.Generator().manual_seed(seed)
    for n, p in module.named_parameters():
        if n.startswith("up."):
            p.copy_(torch.randn(p.shape, generator=g) * std)


# --- the band split ------------------------------------------------------------------------------------------

def dft_matrix(n):
    """Orthonormal DFT, written out: F[j, k] = exp(-2 pi i j k / n) / sqrt(n)."""
    j = torch.arange(n, dtype=torch.float64)
    return torch.exp(-2j * math.pi * torch.outer(j, j) / n) / math.sqrt(n)


def signed_frequency(n):
    """Cycles per patch of each DFT bin: k / n for k <= n / 2, (k - n) / n above (so |f| <= 0.5)."""
    return torch.tensor([(k if k <= n - k else k - n) / n for k in range(n)], dtype=torch.float64)


def reference_bands(v, grid, ratio):
    """low = Re(D^H diag(m) D v) with D = F_h (x) F_w over the flattened grid; high = v - low."""
    h, w = grid
    D = torch.kron(dft_matrix(h), dft_matrix(w))  # [P, P]
    fy, fx = signed_frequency(h).abs(), signed_frequency(w).abs()
    m = ((fy[:, None] <= ratio / 2) & (fx[None, :] <= ratio / 2)).reshape(-1).to(torch.complex128)
    project = D.conj().T @ torch.diag(m) @ D  # the low-pass projection, [P, P]
    assert project.imag.abs().max() < 1e-12  # a mask symmetric in +-f: a real projection
    low = torch.einsum("pq,bqc->bpc", project.real.to(v.dtype), v)
    return low, v - low


@pytest.mark.parametrize("grid, ratio", [((4, 4), 0.3), ((4, 4), 0.5), ((8, 8), 0.3), ((3, 5), 0.7), ((4, 6), 0.0)])
def test_band_split_matches_an_explicit_dft_matrix_outputs_and_gradients(grid, ratio):
    torch.manual_seed(0)
    v = torch.randn(3, grid[0] * grid[1], 7, dtype=torch.float64, requires_grad=True)
    got, want = split_bands(v, grid, ratio), reference_bands(v, grid, ratio)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    torch.testing.assert_close(got[0] + got[1], v, atol=1e-12, rtol=0)  # the bands sum to the features
    d = [torch.randn_like(t) for t in got]
    g1 = torch.autograd.grad(sum((t * e).sum() for t, e in zip(got, d)), v)[0]
    g2 = torch.autograd.grad(sum((t * e).sum() for t, e in zip(want, d)), v)[0]
    torch.testing.assert_close(g1, g2, atol=1e-10, rtol=0)


def test_the_mask_is_a_box_around_dc():
    # 32 x 32 at the paper's 0.3: |k| <= 4 on each axis (the paper's box is k in [-4, 3])
    m = low_mask(32, 32, 0.3)
    k = [int(i) for i in torch.nonzero(m[:, 0]).flatten()]
    assert k == [0, 1, 2, 3, 4, 28, 29, 30, 31] and m.sum() == 81
    assert low_mask(4, 4, 0.3).sum() == 1 and low_mask(4, 4, 0.3)[0, 0]  # a 4 x 4 grid at 0.3: DC alone
    assert low_mask(4, 4, 0.5).sum() == 9  # |k| <= 1
    assert not low_mask(4, 4, 0.99).all()  # below 1 the Nyquist bins stay high


def test_dc_and_nyquist_patterns_land_in_their_bands():
    """A pattern repeated in every patch (period-2 stripes cut into 2 x 2 patches) is the grid mean: all low at the
    default cutoff; one that alternates patch rows (period-4 stripes) is the Nyquist row: all high."""
    c = torch.randn(5)
    flat = c.expand(1, 16, 5)
    low, high = split_bands(flat, (4, 4), 0.3)
    torch.testing.assert_close(low, flat)
    assert high.abs().max() < 1e-6
    alternating = (torch.tensor([1.0, -1.0, 1.0, -1.0]).repeat_interleave(4)[None, :, None] * c).contiguous()
    low, high = split_bands(alternating, (4, 4), 0.5)
    assert low.abs().max() < 1e-6 and torch.allclose(high, alternating, atol=1e-6)


# --- the mixture of adapters ----------------------------------------------------------------------------------

def naive_mixture(module, v, bands):
    """Token by token: softmax(W_r v_t + b_r) over the three experts, each W2 relu(W1 x + b1) + b2 on its band."""
    out = torch.zeros_like(v)
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            logits = module.router.weight @ v[b, t] + module.router.bias
            w = torch.exp(logits - logits.max())
            w = w / w.sum()
            for i in range(3):
                x = bands[i][b, t]
                hidden = torch.clamp(module.down[i].weight @ x + module.down[i].bias, min=0)
                out[b, t] = out[b, t] + w[i] * (module.up[i].weight @ hidden + module.up[i].bias)
    return module.scale * out


@pytest.mark.parametrize("split", ["frequency", "none"])
def test_mixture_forward_and_gradients_match_a_naive_loop(split):
    torch.manual_seed(0)
    module = FrequencyMixture(12, (4, 4), dim=5, cutoff_ratio=0.5, split=split).double()
    randomize(module)
    with torch.no_grad():
        module.scale.fill_(0.7)
    v = torch.randn(2, 16, 12, dtype=torch.float64, requires_grad=True)
    bands = (v, *reference_bands(v, (4, 4), 0.5)) if split == "frequency" else (v, v, v)
    got, want = module(v), naive_mixture(module, v, bands)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    leaves = [v, *module.parameters()]
    d = torch.randn_like(got)
    g1 = torch.autograd.grad((got * d).sum(), leaves)
    g2 = torch.autograd.grad((want * d).sum(), leaves)
    for (name, _), a, b in zip([("input", None), *module.named_parameters()], g1, g2):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"gradient of {name}")
        assert a.abs().max() > 0, name  # every expert, the router and the scale learn


def test_split_none_is_the_same_adapter_without_the_split():
    torch.manual_seed(3)
    freq = FrequencyMixture(12, (4, 4), dim=5, cutoff_ratio=0.3, split="frequency")
    torch.manual_seed(3)
    plain = FrequencyMixture(12, (4, 4), dim=5, cutoff_ratio=0.3, split="none")
    a, b = freq.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same parameters, same start
    randomize(freq), randomize(plain)
    v = torch.randn(2, 16, 12)
    assert all(x is v for x in plain.bands(v))
    assert (freq(v) - plain(v)).abs().max() > 1e-3  # only the bands differ


# --- on zoo_mm ------------------------------------------------------------------------------------------------

def test_attach_leaves_the_outputs_unchanged_and_freezes_the_backbone():
    model = mm()
    inputs = sample_inputs(model)
    with torch.no_grad():
        before = model(**inputs).logits
    backbone = state_bytes(model)
    zoo.apply(model, "earth-adapter", dim=8)
    assert isinstance(model.model.vision, EarthAdapterEncoder) and isinstance(model.model.vision, Encoder)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)  # zero output layers: exactly no change
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("model.vision.adapter.") for n in trainable)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in backbone.items())  # the backbone keeps its names and bytes
    assert model.config.zoo_modules == {"model.vision": {"adapter": "earth-adapter", "dim": 8, "cutoff_ratio": 0.3,
                                                         "split": "frequency", "grid": [4, 4]}}
    step = model.config.zoo_recipe[-1]
    assert step["name"] == "earth-adapter" and step["kind"] == "adapter" and step["options"] == {"dim": 8}


@pytest.mark.parametrize("options, error, message", [
    ({"split": "frequncy"}, ValueError, "did you mean 'frequency'"),
    ({"split": "low"}, ValueError, "split must be one of"),
    ({"cutoff_ratio": 1.0}, ValueError, r"cutoff_ratio must be a number in \[0, 1\)"),
    ({"cutoff_ratio": -0.1}, ValueError, "cutoff_ratio must be"),
    ({"cutoff_ratio": True}, ValueError, "cutoff_ratio"),
    ({"dim": 0}, ValueError, "dim must be an integer >= 1"),
    ({"dim": 2.5}, ValueError, "option 'dim' of earth-adapter must be int"),
    ({"dims": 8}, ValueError, "did you mean 'dim'"),
])
def test_bad_options_leave_the_model_bit_identical(options, error, message):
    model = mm()
    before, recipe = state_bytes(model), list(model.config.zoo_recipe)
    with pytest.raises(error, match=message):
        zoo.apply(model, "earth-adapter", **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(model.model.vision) is Encoder and model.config.zoo_recipe == recipe
    assert all(p.requires_grad for p in model.parameters())


def test_refusals_of_the_model_leave_it_bit_identical():
    model = zoo.apply(mm(), "earth-adapter")
    before, recipe = state_bytes(model), list(model.config.zoo_recipe)
    with pytest.raises(ValueError, match="already carries an earth-adapter"):
        zoo.apply(model, "earth-adapter", split="none")
    assert model.config.zoo_recipe == recipe and model.model.vision.adapter.split == "frequency"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    text = zoo.convert(tiny_model("mixtral"))
    with pytest.raises(TypeError, match="no vision encoder"):
        zoo.apply(text, "earth-adapter")
    assert EarthAdapter.demo_unfit(text) and EarthAdapter.demo_unfit(mm()) == ""


@pytest.mark.parametrize("split", ["frequency", "none"])
def test_save_and_reload_give_identical_weights_and_logits(tmp_path, split):
    model = zoo.apply(mm(), "earth-adapter", dim=4, cutoff_ratio=0.5, split=split)
    randomize(model.model.vision.adapter)
    inputs = sample_inputs(model)
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(again.model.vision, EarthAdapterEncoder) and again.model.vision.adapter.split == split
    state, saved = again.state_dict(), model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(v, state[k]) for k, v in saved.items())
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs).logits, logits, atol=1e-5, rtol=0)
    assert again.config.zoo_recipe[-1]["options"] == {"dim": 4, "cutoff_ratio": 0.5, "split": split}


def test_a_few_steps_train_the_adapter_alone():
    torch.manual_seed(0)
    model = zoo.apply(mm(), "earth-adapter", dim=8)
    inputs = sample_inputs(model)
    labels = inputs["input_ids"].clone()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    losses = []
    for _ in range(15):
        loss = model(**inputs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # only the image tokens move, and this random tiny model's text reads little of them: a small, steady gain
    assert losses[-1] < losses[0] - 0.02 and all(b <= a + 1e-4 for a, b in zip(losses, losses[1:])), losses
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(up.weight.abs().max() > 0 for up in model.model.vision.adapter.up)


def test_card_and_space():
    from zoo.demos.spaces import load_app
    from zoo.publishing.cards import render_component_card

    model = zoo.apply(mm(), "earth-adapter", split="none")
    text = render_component_card(EarthAdapter, {"recipe": model.config.zoo_recipe})
    assert text.startswith("### Adapter: earth-adapter") and 'Applied with `{"split": "none"}`' in text
    assert "arXiv:2504.06220" in text and "Does the paper's claim hold here?" in text
    app = load_app("multimodal-digits")
    assert "earth-adapter" in app.components()
    assert app.card("earth-adapter").startswith("### Adapter: earth-adapter")
