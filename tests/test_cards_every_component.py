"""A card for a tiny Mixtral after each first-party router and compressor that fits it: the component's section, the
given title, no runs of blank lines, each citation once, and YAML that parses back."""
import re

import pytest
import torch
from huggingface_hub import ModelCard

import zoo
from zoo.publishing.cards import ARXIV, render_component_card, unique_citations
from zoo.components.registry import registry
from zoo.testing import tiny_model
from test_check_component import OPTIONS

# first-party components that do not fit a tiny Mixtral, each refused by zoo.apply (checked below)
NOT_FOR_MIXTRAL = {"compressor:prune-group"}  # needs modality-group experts (zoo_mm)


def first_party(kind):
    return sorted(f"{kind}:{c['name']}" for c in zoo.list_components(kind) if c["distribution"] == "moe-zoo")


KEYS = [k for kind in ("router", "compressor") for k in first_party(kind)]


@pytest.fixture(scope="module")
def calibration():
    vocab = tiny_model("mixtral").config.vocab_size
    return [torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(0))]


def citation_lines(text):
    body = text.split("\n## Citations\n", 1)[1] if "\n## Citations\n" in text else ""
    return [ln[2:] for ln in body.splitlines() if ln.startswith("- ")]


@pytest.mark.parametrize("key", KEYS)
def test_a_card_after_each_router_and_compressor(key, calibration, one_thread):
    kind, name = key.split(":")
    model = zoo.convert(tiny_model("mixtral"))
    if key in NOT_FOR_MIXTRAL:
        with pytest.raises((ValueError, TypeError)):
            zoo.apply(model, name, calibration=calibration, **OPTIONS[key])
        return
    zoo.apply(model, name, calibration=calibration, **OPTIONS[key])
    card = zoo.card(model, model_name=f"tiny-{name}", repo_id="org/whatever")
    text = card.content
    assert re.search(rf"^# tiny-{re.escape(name)}$", text, re.M)
    obj = registry.by_kind[kind][name].obj
    context = {"family": "mixtral", "layout_summary": "", "recipe": list(model.config.zoo_recipe)}
    section = [ln.strip() for ln in render_component_card(obj, context).splitlines()]
    missing = [ln for ln in section if ln and ln not in text]
    assert not missing, missing
    assert "\n\n\n" not in text and text.endswith("\n") and not text.endswith("\n\n")
    assert 'from_pretrained("org/whatever")' in text
    cited = citation_lines(text)
    assert cited and len(cited) == len(set(cited))
    ids = [i for line in cited for i in ARXIV.findall(line)]
    assert len(ids) == len(set(ids)), ids
    assert ModelCard(text).data.to_dict() == card.data.to_dict()


def test_the_title_and_the_snippet_follow_the_name_the_repo_or_the_folder(tmp_path):
    model = zoo.convert(tiny_model("mixtral"))
    assert zoo.card(model, repo_id="org/tiny-moe").content.count("\n# tiny-moe\n") == 1
    assert 'from_pretrained("org/tiny-moe")' in zoo.card(model, repo_id="org/tiny-moe").content
    assert "\n# zoo-mixtral\n" in zoo.card(model).content  # nothing to name it after
    model.config.zoo_base_model = "mistralai/Mixtral-8x7B-v0.1"
    assert "\n# Mixtral-8x7B-v0.1\n" in zoo.card(model).content
    model.save_pretrained(tmp_path / "my-moe")
    readme = (tmp_path / "my-moe" / "README.md").read_text()
    assert "\n# my-moe\n" in readme and f'from_pretrained("{tmp_path / "my-moe"}")' in readme
    assert "PATH" not in readme and "\n\n\n" not in readme


def test_a_citation_is_listed_once_by_arxiv_id_or_text():
    assert unique_citations([
        "Jiang et al., Mixtral of Experts, 2024. arXiv:2401.04088",
        "Jiang et al., Mixtral of Experts, 2024, arXiv:2401.04088; Fedus et al., Switch Transformers, arXiv:2101.03961",
        "Qwen Team, Qwen1.5-MoE, 2024", "Qwen Team, Qwen1.5-MoE, 2024.", "",
    ]) == ["Jiang et al., Mixtral of Experts, 2024. arXiv:2401.04088",
           "Fedus et al., Switch Transformers, arXiv:2101.03961", "Qwen Team, Qwen1.5-MoE, 2024"]
