"""Verdicts on the papers' claims: recorded by the benchmarks in docs/claims/, rendered in the cards and README."""
import json

import pytest

from zoo import claims


class Cited:
    name = "cited"
    paper = "Someone et al., A Method, 2025, arXiv:2501.00001"


def test_a_recorded_claim_reads_back_and_a_second_run_replaces_it(tmp_path):
    path = claims.record("cited", "it beats the baseline", "holds", "ppl 10 vs 12", [{"method": "it", "ppl": 10.0}],
                         "python benchmarks/x.py", "zoo-tiny-moe", root=tmp_path)
    assert path == tmp_path / "docs" / "claims" / "cited.json"
    claims.record("cited", "it is fast", "untestable here", "no GPU", {}, "-", "zoo-tiny-moe", root=tmp_path)
    claims.record("cited", "it beats the baseline", "does not hold", "ppl 13 vs 12", [], "python benchmarks/x.py",
                  "zoo-tiny-moe", root=tmp_path)
    entries = claims.load("cited", root=tmp_path)
    assert [(e["claim"], e["verdict"]) for e in entries] == [("it is fast", "untestable here"),
                                                             ("it beats the baseline", "does not hold")]
    assert json.loads(path.read_text())["component"] == "cited" and entries[0]["date"]


@pytest.mark.parametrize("change, match", [({"verdict": "mostly"}, "verdict must be one of"),
                                           ({"summary": " "}, "summary must be"),
                                           ({"numbers": {"x": object()}}, "not JSON serializable")])
def test_bad_records_write_nothing(tmp_path, change, match):
    args = dict(component="cited", claim="c", verdict="holds", summary="s", numbers=[], command="cmd", model="m")
    with pytest.raises((ValueError, TypeError), match=match):
        claims.record(**{**args, **change}, root=tmp_path)
    assert not (tmp_path / "docs").exists()


def test_the_card_section_shows_each_verdict_and_says_when_nothing_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "claims_path", lambda c, root=None: tmp_path / f"{c}.json")
    assert "Not measured on the zoo's models yet" in claims.card_section(Cited)
    claims.record("cited", "it beats the baseline", "holds in part", "on code only", [{"domain": "code", "ppl": 9.5}],
                  "python benchmarks/x.py", "zoo-tiny-moe")
    section = claims.card_section(Cited)
    assert "**it beats the baseline**: **holds in part**. on code only (zoo-tiny-moe" in section
    assert "| domain | ppl |" in section and "| code | 9.5 |" in section


def test_the_readme_table_lists_every_claim(tmp_path):
    claims.record("a", "claim one", "holds", "s", [], "cmd", "zoo-tiny-moe", root=tmp_path)
    claims.record("b", "claim two", "does not hold", "s", [], "cmd", "zoo-tiny-upcycled", root=tmp_path)
    table = claims.readme_table(tmp_path)
    assert table.splitlines()[2:] == ["| `a` | claim one | holds | zoo-tiny-moe |",
                                      "| `b` | claim two | does not hold | zoo-tiny-upcycled |"]


def test_the_readme_table_is_the_recorded_one():
    """README.md's table of claims is what docs/claims/ holds (python -m zoo.claims --readme rewrites it)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = (readme.index(marker) for marker in claims.README_MARKERS)
    assert readme[start + len(claims.README_MARKERS[0]):end].strip() == claims.readme_table().strip()
    assert len(claims.readme_table().splitlines()) > 20  # the first-party claims are recorded
