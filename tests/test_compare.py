"""``moe-zoo compare`` (zoo.evaluation.compare): the grid's measures against the zoo's own, the Pareto front and
budgets against hand-made rows, resumability, streaming, and bad input refused before anything is written."""
import json
import math

import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.evaluation import compare as cmp

GRID = [("base", []), ("reap 6", [("prune-reap", {"num_experts": 6})])]


def row(cell, kv, ppl, weights, cache=0, steps=()):
    return {"cell": cell, "kv": kv, "steps": list(steps), "ppl geo-mean": ppl, "weight bytes": weights,
            "kv bytes": cache, "key": cmp.cell_key(list(steps), kv)}


def test_the_pareto_front_and_the_best_recipe_per_budget():
    rows = [row("base", "full", 10.0, 100), row("a", "full", 11.0, 60, steps=[("x", {})]),
            row("b", "full", 12.0, 70, steps=[("y", {})]), row("c", "int4", 15.0, 20, 5, steps=[("z", {})]),
            {"cell": "broken", "kv": "full", "steps": [], "error": "no"}]
    assert [r["cell"] for r in cmp.pareto(rows)] == ["c", "a", "base"]  # b: more bytes and worse than a
    best = {b["budget"]: b["cell"] for b in cmp.best_per_budget(rows)}
    assert best == {0.25: "c", 0.5: "c", 0.75: "a", 1.0: "base"}
    assert cmp.apply_line("m", [("prune-reap", {"num_experts": 4}), ("quantize", {"bits": 4})]) == \
        "moe-zoo apply m prune-reap:num_experts=4 quantize:bits=4 --out OUT"


def test_a_grid_measures_every_cell_alike_and_a_rerun_skips_what_is_done(tmp_path, monkeypatch, one_thread):
    rows = cmp.compare("zoo-tiny-moe", tmp_path, windows=1, grid=GRID, kv=("full", "int4"))
    assert sorted((r["cell"], r["kv"]) for r in rows) == [("base", "full"), ("base", "int4"), ("reap 6", "full"),
                                                        ("reap 6", "int4")]
    by = {(r["cell"], r["kv"]): r for r in rows}
    # the full-precision cell is the zoo's one-pass perplexity of the same windows
    from zoo.data.tokens import eval_windows, token_stream

    model, tok = zoo.load("zoo-tiny-moe").eval(), zoo.load_tokenizer("zoo-tiny-moe")
    with torch.no_grad():
        ppl = {d: math.exp(model(input_ids=(w := eval_windows(token_stream(d, "val", tok), 256)[:1]),
                                 labels=w).loss.item()) for d in ("english", "code")}
    assert by["base", "full"]["ppl english"] == pytest.approx(ppl["english"], rel=2e-3)
    assert by["reap 6", "full"]["weight bytes"] < by["base", "full"]["weight bytes"]
    assert by["base", "int4"]["kv bytes"] < by["base", "full"]["kv bytes"]
    assert {p.name for p in tmp_path.iterdir()} == set(cmp.FILES)
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert summary["pareto"] and summary["best"][-1]["apply"]
    calls = []
    monkeypatch.setattr(zoo, "apply", lambda *a, **k: calls.append(a))
    again = cmp.compare("zoo-tiny-moe", tmp_path, windows=1, grid=GRID, kv=("full", "int4"))
    assert calls == [] and sorted(r["key"] for r in again) == sorted(r["key"] for r in rows)


def test_a_streamed_grid_writes_each_cell_from_the_shards(tmp_path, one_thread):
    rows = cmp.compare("zoo-tiny-moe", tmp_path, windows=1, grid=GRID[1:], kv=("full", "int8"), stream=True)
    assert [(r["cell"], r["kv"]) for r in rows] == [("reap 6", "full")]  # the cache axis needs the model in memory
    assert (tmp_path / "cells" / "reap_6" / "config.json").is_file()
    assert rows[0]["weight bytes"] > 0 and rows[0]["ppl geo-mean"] > 1


def test_a_bad_precision_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'int8'"):
        cmp.compare("zoo-tiny-moe", tmp_path / "out", kv=("full", "int9"))
    assert not (tmp_path / "out").exists()
    from zoo.cli import cli

    res = CliRunner().invoke(cli, ["compare", "zoo-tiny-moe", "--out", str(tmp_path / "o2"), "--kv", "int9"])
    assert res.exit_code != 0 and "did you mean 'int8'" in res.output and "Traceback" not in res.output


def test_a_model_that_cannot_be_evaluated_stops_the_grid_at_its_first_cell(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(zoo, "apply", lambda *a, **k: calls.append(a))

    def unfit(*a, **k):
        raise ValueError("the tokenizer saved with m has 8192 tokens but the model's vocabulary has 32000")

    monkeypatch.setattr(cmp, "_cell", unfit)
    with pytest.raises(ValueError, match="cannot be evaluated as it is, so no cell can: the tokenizer"):
        cmp.compare("zoo-tiny-moe", tmp_path, windows=1, grid=GRID, kv=("full",))
    assert calls == []  # the pruning cell never ran
    assert cmp.best_per_budget([{"cell": "x", "kv": "full", "steps": [], "error": "no"}]) == []


def test_compare_takes_the_calibration_of_apply(tmp_path, monkeypatch):
    from zoo.cli import cli

    seen = {}
    monkeypatch.setattr(cmp, "compare", lambda *a, **k: seen.update(k) or [])
    res = CliRunner().invoke(cli, ["compare", "zoo-tiny-moe", "--out", str(tmp_path / "o"), "--calibration", "code:512"])
    assert res.exit_code == 0, res.output
    assert seen["calibration"] == {"domain": "code", "tokens": 512, "seq_len": 256, "seed": 0}
    res = CliRunner().invoke(cli, ["compare", "zoo-tiny-moe", "--out", str(tmp_path / "o"), "--calibration", "cod"])
    assert res.exit_code != 0 and "Traceback" not in res.output


def test_skip_leaves_a_cell_out_and_an_unknown_label_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(cmp, "_cell", lambda model, label, steps, precision, windows: measured.append(label) or
                        row(label, precision, 10.0, 100, steps=steps))
    monkeypatch.setattr(zoo, "apply", lambda model, *a, **k: model)
    with pytest.raises(ValueError, match="no cell 'reap 5' in the grid .*did you mean 'reap 6'"):
        cmp.compare("zoo-tiny-moe", tmp_path / "out", windows=1, grid=GRID, kv=("full",), skip=("reap 5",))
    assert not (tmp_path / "out").exists() and measured == []
    rows = cmp.compare("zoo-tiny-moe", tmp_path / "out", windows=1, grid=GRID, kv=("full",), skip=("reap 6",))
    assert measured == ["base"] and [r["cell"] for r in rows] == ["base"]
