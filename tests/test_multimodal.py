"""zoo_multimodal: digits data, the ZooMMProcessor, modality-groups experts, hierarchical-modality and
language-conditioned routers against naive references, a few training steps, save/load, prune-group."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoProcessor

import zoo  # first: loading the plugins before importing a plugin's modules directly

# isort: split
from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
from zoo_multimodal.dataset import MODES, Split, batch
from zoo_multimodal.hierarchical_modality import HierarchicalModality
from zoo_multimodal.language_conditioned import LanguageConditioned
from zoo_multimodal.modality_groups import ModalityGroupExperts
from zoo_multimodal.modeling_zoo_mm import ZooMMForCausalLM
from zoo.moe import RoutingContext
from zoo_multimodal.processing_zoo_mm import ZooMMProcessor

from zoo.architectures.family import NotExportable
from zoo_multimodal import digits as dm

pytestmark = pytest.mark.usefixtures("one_thread")
SUBSET = {"voices": ("en-us", "en+f1"), "speeds": (160,), "pitches": (50,)}  # 20 clips, one train and one test voice


@pytest.fixture(scope="module")
def subset():
    """Synthesised once: a manifest and the clips of SUBSET."""
    chosen = dm.clips(**{k: SUBSET[k] for k in ("voices", "speeds", "pitches")})
    return dm.generate(None, progress=False, **SUBSET), {c.key: dm.synthesise(c) for c in chosen}


@pytest.fixture(scope="module")
def processor():
    return ZooMMProcessor()


@pytest.fixture(scope="module")
def split(subset, processor):
    """A small real Split: 200 train images and the subset's clips."""
    images, labels = dm.load_images()
    idx = dm.image_split(len(images))["train"][:200]
    clips = subset[1]
    return Split(torch.stack([processor.image_patches(im) for im in images[idx]]), torch.as_tensor(labels[idx]),
                 {None: torch.stack([processor.log_mel(a, dm.SAMPLE_RATE) for a in clips.values()])},
                 torch.tensor([dm.WORDS.index(k.split("|")[-1]) for k in clips]))


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = {"vocab_size": 25, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "moe_intermediate_size": 32,
               "group_sizes": [2, 3, 3], "top_groups": 2, "num_experts_per_tok": 2, "vision_experts": 3}
    return ZooMMForCausalLM(ZooMMConfig(**{**cfg, **overrides})).eval()


# ---- data --------------------------------------------------------------------------------------------------

def test_data_generation_is_deterministic_and_matches_the_shipped_checksums(subset):
    manifest, clips = subset
    again = dm.generate(None, progress=False, **SUBSET)
    assert again["clips"] == manifest["clips"] and len(manifest["clips"]) == 20
    assert manifest["speech"] == again["speech"] and manifest["images"] == again["images"]
    shipped = json.loads(dm.MANIFEST.read_text())
    assert manifest["images"] == shipped["images"]  # sklearn's digits and the image split
    assert shipped["voices"]["train"] == list(dm.TRAIN_VOICES) and shipped["voices"]["test"] == list(dm.TEST_VOICES)
    assert len(shipped["clips"]) == 1080 and not set(dm.TRAIN_VOICES) & set(dm.TEST_VOICES)
    # Speech checksums depend on espeak-ng's version (its synthesis changes between releases): with another
    # version the determinism asserted above still holds, but the shipped clip checksums cannot match, so
    # that last comparison is skipped with the two versions named. CI's Debian espeak-ng is the shipped one.
    if shipped["espeak_ng"] != manifest["espeak_ng"]:
        pytest.skip(f"espeak-ng {manifest['espeak_ng']} here, the manifest was made with {shipped['espeak_ng']}")
    assert all(shipped["clips"][k] == v for k, v in manifest["clips"].items())
    assert all(dm.sha256(a) == manifest["clips"][k] for k, a in clips.items())


def test_noise_has_the_requested_snr(subset):
    clean = next(iter(subset[1].values())).astype(np.float32)
    noisy = dm.add_noise(clean, 5.0, seed=1)
    snr = 10 * np.log10(np.mean(clean ** 2) / np.mean((noisy - clean) ** 2))
    assert abs(snr - 5.0) < 0.2 and np.array_equal(noisy, dm.add_noise(clean, 5.0, seed=1))


# ---- processor ---------------------------------------------------------------------------------------------

def test_processor_round_trip_through_auto_processor(tmp_path, processor, subset):
    images, _ = dm.load_images()
    clip = next(iter(subset[1].values()))
    kw = {"text": ["which digit ?", "name the digit ."], "images": [images[3], None], "audio": [None, clip],
              "answers": ["three", "zero"]}
    before = processor(**kw)
    processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded) is ZooMMProcessor and loaded.audio_frames == processor.audio_frames
    after = loaded(**kw)
    assert set(before) == set(after) == {"input_ids", "attention_mask", "labels", "pixel_values", "image_mask",
                                         "audio_features", "audio_mask"}
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert before["pixel_values"].shape == (2, 16, 4) and before["audio_features"].shape == (2, 16, 32)
    assert before["image_mask"].tolist() == [1, 0] and before["audio_mask"].tolist() == [0, 1]
    assert loaded.tokenizer.decode(before["labels"][0][before["labels"][0] >= 0]) == "three <eos>"
    # audio at another rate (a browser microphone) gives the same features within resampling error
    up = np.interp(np.arange(0, len(clip), 22050 / 48000), np.arange(len(clip)), clip.astype(np.float32))
    assert torch.nn.functional.cosine_similarity(processor.log_mel(up, 48000).flatten(),
                                                 processor.log_mel(clip, 22050).flatten(), dim=0) > 0.95


# ---- components against naive references ------------------------------------------------------------------

def test_modality_groups_experts_match_a_naive_loop():
    torch.manual_seed(0)
    experts = ModalityGroupExperts([2, 1, 3], hidden_size=16, intermediate_size=8)
    assert experts.num_experts == 6 and list(experts.group_range("audio")) == [3, 4, 5]
    assert experts.group_of == [0, 0, 1, 2, 2, 2]
    router = HierarchicalModality(16, 6, 2, group_sizes=[2, 1, 3], top_groups=2)
    x = torch.randn(12, 16, requires_grad=True)
    routing = router(x)
    out = experts(x, routing)
    ref = torch.stack([sum(routing.weights[t, s] * experts.expert(int(routing.indices[t, s]), x[t:t + 1])[0]
                           for s in range(2)) for t in range(12)])
    torch.testing.assert_close(out, ref)
    g1 = torch.autograd.grad(out.square().sum(), [x, experts.gate_up_proj, experts.down_proj])
    x2 = x.detach().requires_grad_()
    ref = torch.stack([sum(routing.weights[t, s].detach() * experts.expert(int(routing.indices[t, s]), x2[t:t + 1])[0]
                           for s in range(2)) for t in range(12)])
    g2 = torch.autograd.grad(ref.square().sum(), [x2, experts.gate_up_proj, experts.down_proj])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    rebuilt = ModalityGroupExperts(**experts.options())
    assert rebuilt.group_sizes == [2, 1, 3] and rebuilt.groups == ["text", "vision", "audio"]


@pytest.mark.parametrize("top_groups,top_k", [(1, 1), (1, 2), (2, 2), (3, 3)])
def test_hierarchical_routing_shapes_and_group_constraint(top_groups, top_k):
    torch.manual_seed(1)
    sizes = [2, 3, 4]
    router = HierarchicalModality(16, 9, top_k, group_sizes=sizes, top_groups=top_groups)
    with torch.no_grad():
        router.group_weight.normal_(0, 1)
        router.weight.normal_(0, 1)
    x = torch.randn(20, 16)
    r = router(x)
    assert r.weights.shape == r.indices.shape == (20, top_k) and r.logits.shape == (20, 9)
    group_of = torch.tensor(router.group_of)
    chosen = router.group_logits(x).topk(top_groups, -1).indices
    per = top_k // top_groups
    for t in range(20):  # naive: the top groups, then the best `per` experts inside each
        expect, weights = [], []
        gw = router.group_logits(x[t])[chosen[t]].softmax(-1)
        for j, g in enumerate(chosen[t].tolist()):
            members = (group_of == g).nonzero().flatten()
            lg = router.gate_logits(x[t])[members]
            top = lg.topk(per)
            expect += members[top.indices].tolist()
            weights += (gw[j] * top.values.softmax(-1)).tolist()
        assert r.indices[t].tolist() == expect
        torch.testing.assert_close(r.weights[t], torch.tensor(weights))
        assert set(group_of[r.indices[t]].tolist()) == set(chosen[t].tolist())  # experts inside chosen groups
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(20))
    torch.testing.assert_close(r.logits.exp().sum(-1), torch.ones(20))  # one two-level distribution
    with pytest.raises(ValueError, match="smallest group"):
        HierarchicalModality(16, 9, 3, group_sizes=sizes, top_groups=1)
    with pytest.raises(ValueError, match="sum to"):
        HierarchicalModality(16, 8, 2, group_sizes=sizes)


def naive_group_load_loss(group_probs, modality, real, modalities):
    """MoHAVE's group-load biasing, written out: per bound modality present, -log(mean own-group probability)."""
    tags = {"text": 0, "vision": 1, "audio": 2}
    terms = []
    for g, name in enumerate(modalities):
        own = [group_probs[t, g] for t in range(len(modality)) if modality[t] == tags[name] and real[t]]
        if own:
            terms.append(-torch.log(sum(own) / len(own)))
    return sum(terms) / len(terms)


def test_group_load_biasing_loss_matches_a_naive_sum_and_leaves_routing_alone():
    torch.manual_seed(4)
    sizes = [2, 3, 3]
    bound = HierarchicalModality(16, 8, 2, group_sizes=sizes, modalities=["text", "vision", "audio"])
    plain = HierarchicalModality(16, 8, 2, group_sizes=sizes)
    plain.load_state_dict(bound.state_dict())
    with torch.no_grad():
        bound.group_weight.normal_(0, 1)
        plain.group_weight.copy_(bound.group_weight)
    x = torch.randn(2 * 10, 16)
    modality = torch.tensor([[1] * 4 + [2] * 3 + [0] * 3, [2] * 6 + [0] * 4])  # [B, S] vision/audio/text tags
    mask = torch.ones(2, 10)
    mask[1, :2] = 0  # two padded audio tokens do not count
    context = RoutingContext(modality=modality, attention_mask=mask)
    bound.train()
    r_bound, r_plain = bound(x, context), plain(x, context)
    assert torch.equal(r_bound.indices, r_plain.indices) and torch.equal(r_bound.weights, r_plain.weights)
    assert plain.group_load_loss is None  # unbound: no loss
    expect = naive_group_load_loss(bound.group_probs(x), modality.reshape(-1), mask.reshape(-1).bool(),
                                   bound.modalities)
    torch.testing.assert_close(bound.group_load_loss, expect)
    bound.eval()
    bound(x, context)
    assert bound.group_load_loss is None  # a training objective only
    # it pulls each modality's tokens toward its own group
    bound.train()
    opt = torch.optim.SGD([bound.group_weight], lr=0.5)
    own = lambda: float(torch.stack([bound.group_probs(x).detach()[modality.reshape(-1) == g, g].mean() for g in range(3)]).mean())
    before = own()
    for _ in range(30):
        opt.zero_grad()
        bound(x, context)
        bound.group_load_loss.backward()
        opt.step()
    assert own() > before + 0.15
    with pytest.raises(ValueError, match="modalities must name"):
        HierarchicalModality(16, 8, 2, group_sizes=sizes, modalities=["text", "vision"])
    with pytest.raises(ValueError, match="modalities must name"):
        HierarchicalModality(16, 8, 2, group_sizes=sizes, modalities=["text", "audio", "audio"])
    assert "modalities" not in plain.options and bound.options["modalities"] == ["text", "vision", "audio"]


def test_training_binds_groups_to_modalities_and_saves_the_binding(tmp_path):
    from zoo_multimodal.hierarchical_modality import bind_groups, group_load_loss

    config = ZooMMConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, moe_intermediate_size=16,
                         group_sizes=[2, 2, 2], vision_experts=0)
    model = ZooMMForCausalLM(config)
    routers = bind_groups(model)
    assert [r.modalities for r in routers] == [["text", "vision", "audio"]]
    model.train()
    ids = torch.randint(3, 32, (2, 5))
    model(input_ids=ids, pixel_values=torch.randn(2, 16, 4), audio_features=torch.randn(2, 16, 32))
    assert group_load_loss(routers) is not None and group_load_loss(routers).requires_grad
    model.eval()
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.model.layers[0].mlp.router.modalities == ["text", "vision", "audio"]


def test_language_conditioned_routing_matches_naive_cross_attention():
    torch.manual_seed(2)
    router = LanguageConditioned(16, 5, 2, context_size=12)
    with torch.no_grad():
        router.weight.normal_(0, 1)
    visual, text = torch.randn(3, 4, 16), torch.randn(3, 6, 12)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    r = router(visual.reshape(12, 16), RoutingContext(prompt_embeds=text, prompt_mask=mask))
    for b in range(3):
        n = int(mask[b].sum())
        q = router.q_proj.weight @ visual[b].mean(0)
        keys, values = text[b, :n] @ router.k_proj.weight.T, text[b, :n] @ router.v_proj.weight.T
        att = torch.softmax(keys @ q / 4.0, 0)
        probs = torch.softmax(router.weight @ (att @ values), 0)
        top = probs.topk(2)
        for p in range(4):  # every visual token of image b shares its routing
            assert r.indices[4 * b + p].tolist() == top.indices.tolist()
            torch.testing.assert_close(r.weights[4 * b + p], top.values / top.values.sum())
    other = text.clone()
    other[0, :, :] = torch.randn(6, 12) * 3
    steered = router(visual.reshape(12, 16), RoutingContext(prompt_embeds=other, prompt_mask=mask))
    assert not torch.equal(steered.logits[0], r.logits[0])  # the text steers the choice
    plain = router(visual.reshape(12, 16), None)
    torch.testing.assert_close(plain.logits, router.gate_logits(visual.reshape(12, 16)))


# ---- the model --------------------------------------------------------------------------------------------

def test_model_inputs_with_missing_modalities(split, processor):
    model = tiny_model()
    inputs = batch(processor, split, [3, 5, 7], ["image", "audio", "both"])
    out = model(**inputs, output_router_logits=True)
    assert out.logits.shape == (3, inputs["input_ids"].shape[1], 25) and torch.isfinite(out.loss)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (3 * (16 + 16 + inputs["input_ids"].shape[1]), 8)
    text_only = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert text_only.shape == out.logits.shape
    masked = {**inputs, "pixel_values": torch.randn_like(inputs["pixel_values"])}
    masked["pixel_values"][2] = inputs["pixel_values"][2]  # only row 2 has an image: others must not change
    again = model(**masked).logits
    torch.testing.assert_close(again[1], out.logits[1])
    with pytest.raises(NotExportable, match="native"):
        zoo.export(model, "/nonexistent/never-written")


def test_a_few_training_steps_lower_the_loss(split, processor):
    model = tiny_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    inputs = batch(processor, split, rng.integers(10, size=24), [MODES[i % 3] for i in range(24)], rng=rng)
    losses = []
    for _ in range(12):
        out = model(**inputs, output_router_logits=True)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(p.grad is not None for n, p in model.named_parameters() if "group_weight" in n or "q_proj" in n)


def test_save_and_reload_through_the_auto_classes(tmp_path, split, processor):
    model = tiny_model(seed=3)
    inputs = batch(processor, split, [1, 2, 9], ["image", "audio", "both"])
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "zoo_mm" and cfg["zoo_layout"][0]["experts"] == "modality-groups"
    assert cfg["zoo_vision_moe"]["router"] == "language-conditioned"
    assert "### Router: hierarchical-modality" in (tmp_path / "README.md").read_text()
    for again in (AutoModelForCausalLM.from_pretrained(tmp_path).eval(), zoo.load(tmp_path).eval()):
        assert type(again) is ZooMMForCausalLM
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, logits)


def test_prune_group_applies_and_round_trips(tmp_path, split, processor):
    model = tiny_model(seed=4)
    calibration = [batch(processor, split, np.arange(30) % 10, [MODES[i % 3] for i in range(30)])]
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="no group"):
        zoo.apply(model, "prune-group", calibration=calibration, group="smell", num_experts=1)
    with pytest.raises(ValueError, match="has 3"):
        zoo.apply(model, "prune-group", calibration=calibration, group="audio", num_experts=4)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # refused: unchanged
    model = zoo.apply(model, "prune-group", calibration=calibration, group="audio", num_experts=1)
    for entry in model.config.zoo_layout:
        assert entry["experts_options"]["group_sizes"] == [2, 3, 1] and entry["num_experts"] == 6
        assert entry["router_options"]["group_sizes"] == [2, 3, 1]
    step = model.config.zoo_recipe[-1]
    assert step["name"] == "prune-group" and set(step["results"]["kept"]) == {"0", "1"}
    assert all(len(k) == 1 and 5 <= k[0] <= 7 for k in step["results"]["kept"].values())
    # the experts of the other groups are untouched
    old = before["model.layers.0.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(model.model.layers[0].mlp.experts.gate_up_proj[:5], old[:5])
    inputs = batch(processor, split, [4, 6], ["audio", "both"])
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, logits)
    assert "### Compressor: prune-group" in (tmp_path / "README.md").read_text()


def test_components_are_registered():
    names = {(c["kind"], c["name"]): c for c in zoo.list_components()}
    for key in [("experts", "modality-groups"), ("router", "hierarchical-modality"),
                ("router", "language-conditioned"), ("architecture", "zoo_mm"), ("compressor", "prune-group"),
                ("adapter", "earth-adapter")]:
        assert key in names and names[key]["space"] == "multimodal-digits" and names[key]["card"]


def test_the_space_answers_from_a_drawn_digit_and_speech(subset):
    """The multimodal-digits Space's answer function on the shipped model: an RGB drawing (white ink on
    black, larger than 8x8, as a Sketchpad gives) and a spoken digit give ten probabilities, a group-usage
    plot and one usage row per modality present."""
    from zoo.demos.spaces import load_app

    app = load_app("multimodal-digits")
    images, labels = dm.load_images()
    i = int(np.nonzero(labels == 7)[0][0])
    drawing = np.kron(images[i] / 16 * 255, np.ones((16, 16)))[..., None].repeat(3, -1).astype(np.uint8)
    key, samples = next((k, a) for k, a in subset[1].items() if k.endswith("|seven"))
    probs, figure, table = app.answer(drawing, (dm.SAMPLE_RATE, samples), "which digit ?", None)
    assert set(probs) == set(app.WORDS) and abs(sum(probs.values()) - 1) < 1e-4
    assert figure is not None and {row[0] for row in table[:-1]} == {"text", "vision", "audio"}
    image_only, _, table = app.answer(drawing, None, "which digit ?", None)
    assert {row[0] for row in table[:-1]} == {"text", "vision"}
