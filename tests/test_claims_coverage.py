"""Every first-party router, compressor, adapter and experts kind that cites a paper has its verdict recorded
(``docs/claims/<component>.json``, written by a claim benchmark through ``zoo.evaluation.claims.record``) and its card shows
it under "Does the paper's claim hold here?"."""
import pytest

import zoo
from zoo.publishing.cards import render_component_card
from zoo.evaluation.claims import FIELDS, VERDICTS, find, load
from zoo.components.registry import registry

KINDS = ("router", "compressor", "adapter", "experts")


def citing():
    out = []
    for kind in KINDS:
        for c in zoo.list_components(kind):
            if c["distribution"] == "moe-zoo" and c.get("paper"):
                out.append((kind, c["name"]))
    return sorted(set(out))


def test_some_components_cite_papers():
    assert len(citing()) >= 20  # the check below would pass vacuously if the listing broke


@pytest.mark.parametrize("kind,name", citing(), ids=[f"{k}:{n}" for k, n in citing()])
def test_paper_claim_recorded_and_shown(kind, name):
    component = registry.get(kind, name).obj
    path = find(name, owner=component)
    assert path is not None, f"{kind} {name} cites a paper but has no docs/claims/{name}.json"
    entries = load(name, owner=component)
    assert entries, f"{path}: no claim recorded"
    for e in entries:
        assert set(FIELDS) <= set(e), f"{path}: an entry lacks {set(FIELDS) - set(e)}"
        assert e["verdict"] in VERDICTS, f"{path}: verdict {e['verdict']!r} is not one of {VERDICTS}"
        for field in ("claim", "summary", "command", "model"):
            assert isinstance(e[field], str) and e[field].strip(), f"{path}: empty {field}"
    card = render_component_card(component)
    assert "Does the paper's claim hold here?" in card
    assert "Not measured on the zoo's models yet" not in card
    for e in entries:
        assert f"**{e['claim']}**: **{e['verdict']}**" in card, f"{name}'s card does not show {e['claim']!r}"
