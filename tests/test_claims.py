"""Verdicts on the papers' claims: recorded by the benchmarks in docs/claims/, rendered in the cards and README."""
import json

import pytest

from zoo.evaluation import claims


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
    """README.md's table of claims is what docs/claims/ holds (python -m zoo.evaluation.claims --readme rewrites it)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = (readme.index(marker) for marker in claims.README_MARKERS)
    assert readme[start + len(claims.README_MARKERS[0]):end].strip() == claims.readme_table().strip()
    assert len(claims.readme_table().splitlines()) > 20  # the first-party claims are recorded


# ------------------------------------------------------------------------------------------------ the one rule

def test_the_rule_holds_only_beyond_the_noise_of_the_repeats():
    from zoo.evaluation.claims import judge

    # lower is better: the mechanism 0.5 better, seeds spread 0.2 -> holds
    j = judge([10.0, 10.2, 10.1], [10.6, 10.7, 10.5])
    assert j["verdict"] == "holds" and j["margin"] == pytest.approx(0.5) and j["noise"] == pytest.approx(0.2)
    assert j["repeats"] == 3 and not j["paired"]
    # the same gap inside a wider spread -> inconclusive, not a win
    assert judge([10.0, 10.9, 9.4], [10.6, 10.7, 10.5])["verdict"] == "inconclusive"
    # worse by more than the noise -> does not hold; higher-is-better flips the sign
    assert judge([11.0, 11.1], [10.0, 10.1])["verdict"] == "does not hold"
    assert judge([11.0, 11.1], [10.0, 10.1], lower_is_better=False)["verdict"] == "holds"
    # a margin exactly at the noise is not beyond it
    assert judge([1.0, 2.0], [2.0, 3.0])["verdict"] == "inconclusive"


def test_paired_draws_measure_the_noise_of_the_differences():
    from zoo.evaluation.claims import judge

    # every draw moves both arms alike (large spread per arm) but the mechanism wins each by 0.1 +- 0.01
    mech, ctrl = [5.0, 9.0, 7.0], [5.1, 9.11, 7.1]
    assert judge(mech, ctrl)["verdict"] == "inconclusive"  # as independent seeds: buried in the draws' spread
    j = judge(mech, ctrl, paired=True)
    assert j["verdict"] == "holds" and j["noise"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="paired"):
        judge([1.0, 2.0, 3.0], [1.0, 2.0], paired=True)


def test_one_repeat_has_no_noise_and_is_refused():
    from zoo.evaluation.claims import judge

    with pytest.raises(ValueError, match="at least two repeats"):
        judge([1.0], [2.0, 3.0])


def test_identical_arms_are_inconclusive_whatever_the_numbers():
    import torch

    from zoo.evaluation.claims import SAME_MODEL, judge, same_weights

    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert same_weights(a, b)
    with torch.no_grad():
        b.bias[0] += 1e-7
    assert not same_weights(a, b)
    j = judge([1.0, 1.1], [5.0, 5.1], same_model=True, why_same="every layer got 4 bits")
    assert j["verdict"] == "inconclusive" and j["reason"] == f"{SAME_MODEL}: every layer got 4 bits"


def test_parts_combine_into_one_verdict():
    from zoo.evaluation.claims import combine

    assert combine(["holds", "holds"]) == "holds"
    assert combine(["holds", "inconclusive"]) == "holds in part"
    assert combine(["holds", "does not hold"]) == "holds in part"
    assert combine(["inconclusive", "does not hold"]) == "does not hold"
    assert combine(["inconclusive", "inconclusive"]) == "inconclusive"


def test_a_record_keeps_the_judgements_and_the_card_shows_them(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from zoo.evaluation import claims

    j = claims.judge([1.0, 1.1], [2.0, 2.05])
    claims.record("widget", "c", j["verdict"], "s", [], "python x.py", "m", root=tmp_path, judgements={"a vs b": j})
    entry = claims.load("widget", tmp_path)[0]
    assert entry["judgements"]["a vs b"]["noise"] == pytest.approx(0.1)
    monkeypatch.setattr(claims, "load", lambda name, owner=None, root=None: [entry])
    text = claims.card_section(SimpleNamespace(name="widget", paper="p"))
    assert "a vs b: holds, margin 0.975 vs noise 0.1 over 2 seeds" in text


def test_every_claims_file_is_written_by_the_script_it_names():
    """No verdict by hand: each entry's command runs a benchmark that calls ``record`` for that component."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "docs" / "claims").glob("*.json"))
    assert files
    for path in files:
        for entry in json.loads(path.read_text())["claims"]:
            script = re.match(r"python (benchmarks/\S+\.py)", entry["command"])
            assert script, f"{path.name}: {entry['command']!r} names no benchmark script"
            source = (root / script.group(1)).read_text()
            assert "record(" in source and f'"{path.stem}"' in source, \
                f"{path.name}: {script.group(1)} does not record {path.stem!r} claims"


def test_a_difference_in_either_direction_holds_only_beyond_the_noise():
    from zoo.evaluation.claims import judge_differs

    assert judge_differs([2.0, 2.1], [1.0, 1.05])["verdict"] == "holds"
    assert judge_differs([1.0, 1.05], [2.0, 2.1])["verdict"] == "holds"
    assert judge_differs([1.0, 1.3], [1.1, 1.1])["verdict"] == "inconclusive"


def test_every_recorded_verdict_is_the_rules_verdict_of_its_judged_comparisons():
    """Every entry (but "untestable here") keeps the comparisons behind it, each with its repeats (>= 2), margin and
    noise, and the entry's verdict is ``combine`` of those not marked as standing beside the claim."""
    import json
    from pathlib import Path

    from zoo.evaluation.claims import combine

    root = Path(__file__).resolve().parent.parent
    checked = 0
    for path in sorted((root / "docs" / "claims").glob("*.json")):
        for entry in json.loads(path.read_text())["claims"]:
            if entry["verdict"] == "untestable here":
                continue
            judged = entry.get("judgements") or {}
            assert judged, f"{path.name}: {entry['claim']!r} has no judged comparison"
            for name, j in judged.items():
                assert j["repeats"] >= 2 and isinstance(j["margin"], float) and j["noise"] >= 0, (path.name, name)
            counted = [j["verdict"] for name, j in judged.items() if "beside the claim" not in name]
            assert entry["verdict"] == combine(counted), (path.name, entry["claim"])
            checked += 1
    assert checked >= 40
