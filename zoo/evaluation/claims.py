"""Verdicts on the papers' claims, measured on the zoo's own models: ``docs/claims/<component>.json``.

A claim benchmark calls ``record`` with what it measured; the file keeps one entry per claim (a second run of
the same claim replaces it) with the numbers, the verdict, the command that measured it, the model, the commit
and the date. Component cards render the entries as "Does the paper's claim hold here?", and
``python -m zoo.evaluation.claims`` prints the README's table of every claim (``--readme`` writes it into README.md).

One rule decides every verdict (``judge``): each arm's measure is repeated (seeds, calibration draws, or evaluation
draws shared by both arms), the repeats' spread is the run's own noise, and the mechanism holds only when it beats
the control arm, which lacks only the mechanism, by more than that noise; the other way round it does not hold;
between the two, or when the arms are the same model, the claim is inconclusive and the entry says why. A claim of
several parts combines its parts' verdicts (``combine``). The entry keeps the repeats, the noise and the margin.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

from zoo.io.atomic import write_text

VERDICTS = ("holds", "holds in part", "does not hold", "inconclusive", "untestable here")
FOLDER = "docs/claims"
FIELDS = ("claim", "verdict", "summary", "numbers", "command", "model", "commit", "date")
SAME_MODEL = "the arms are the same model"


def _spread(values) -> float:
    return max(values) - min(values)


def judge(mechanism, control, lower_is_better: bool = True, paired: bool = False, same_model: bool = False,
          why_same: str = "") -> dict:
    """The one verdict rule. ``mechanism``, ``control``: the claim's measure (a geometric mean over domains unless
    the claim is about one domain) for each repeat, at least two each. ``paired``: repeat i of both arms saw the
    same draw (the same evaluation windows of deterministic models): the noise is the spread of the per-draw
    differences; otherwise (independent seeds) the larger of the two arms' spreads. ``same_model``: the two arms
    produced the same weights (``same_weights``), which makes the comparison empty whatever the numbers say.

    Returns {"verdict", "margin" (mechanism's advantage, mean over repeats, > 0 = better), "noise", "repeats",
    "mechanism", "control" (the means), "paired", "reason"}."""
    mechanism, control = [float(v) for v in mechanism], [float(v) for v in control]
    if len(mechanism) < 2 or len(control) < 2:
        raise ValueError("judge needs at least two repeats of each arm: one run has no noise to compare against")
    if paired and len(mechanism) != len(control):
        raise ValueError(f"paired repeats need as many of each arm, got {len(mechanism)} and {len(control)}")
    sign = -1.0 if lower_is_better else 1.0
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    margin = sign * (mean(mechanism) - mean(control))
    noise = (_spread([sign * (m - c) for m, c in zip(mechanism, control)]) if paired
             else max(_spread(mechanism), _spread(control)))
    out = {"mechanism": mean(mechanism), "control": mean(control), "margin": margin, "noise": noise,
           "repeats": len(mechanism), "paired": paired}
    if same_model:
        return {**out, "verdict": "inconclusive", "reason": SAME_MODEL + (f": {why_same}" if why_same else "")}
    if margin > noise:
        return {**out, "verdict": "holds", "reason": f"better by {margin:.4g}, more than the noise {noise:.4g}"}
    if -margin > noise:
        return {**out, "verdict": "does not hold", "reason": f"worse by {-margin:.4g}, more than the noise {noise:.4g}"}
    return {**out, "verdict": "inconclusive", "reason": f"the difference {margin:.4g} is within the noise {noise:.4g}"}


def judge_differs(measured, predicted, paired: bool = True) -> dict:
    """The rule for a claim that two quantities differ, in either direction (e.g. "a composition is not what its
    parts predict"): holds when the difference exceeds the noise (``judge``'s margin and noise, sign ignored);
    otherwise inconclusive (a difference within the noise cannot show that there is none)."""
    j = judge(measured, predicted, paired=paired)
    if j["verdict"] == "inconclusive":
        return j
    return {**j, "verdict": "holds", "reason": f"apart by {abs(j['margin']):.4g}, more than the noise {j['noise']:.4g}"}


def combine(verdicts) -> str:
    """A claim of several parts: holds when every part holds, does not hold when none holds and one fails, holds in
    part when some hold, inconclusive when no part is decided."""
    verdicts = list(verdicts)
    if not verdicts:
        raise ValueError("combine needs at least one verdict")
    if all(v == "holds" for v in verdicts):
        return "holds"
    if any(v == "holds" for v in verdicts):
        return "holds in part"
    return "does not hold" if any(v == "does not hold" for v in verdicts) else "inconclusive"


def same_weights(a, b) -> bool:
    """Whether two models hold bit-identical tensors under the same names (two arms that are one model)."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype
                                          and torch.equal(sa[k], sb[k]) for k in sa)


def claims_path(component: str, root: str | os.PathLike | None = None) -> Path:
    """Where ``component``'s claims live: ``docs/claims/<component>.json`` of the checkout (or ``root``)."""
    base = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    return base / FOLDER / f"{component}.json"


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def record(component: str, claim: str, verdict: str, summary: str, numbers, command: str, model: str,
           root: str | os.PathLike | None = None, judgements: dict | None = None) -> Path:
    """Write (or replace) the entry for ``claim`` in ``component``'s claims file. ``numbers``: what was measured,
    JSON-able (a table as a list of row dicts reads best in the card). ``judgements``: {comparison: ``judge``'s
    result} behind the verdict (the repeats, noise and margin of each), kept in the entry. Returns the file's path."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    for name, value in (("component", component), ("claim", claim), ("summary", summary), ("command", command),
                        ("model", model)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    json.dumps([numbers, judgements])  # JSON-able, or a TypeError before anything is written
    path = claims_path(component, root)
    entries = [e for e in load(component, root if root is not None else path.parent.parent.parent)
               if e["claim"] != claim]
    entries.append({"claim": claim, "verdict": verdict, "summary": summary, "numbers": numbers, "command": command,
                    "model": model, "commit": _commit(path.parent), "date": datetime.date.today().isoformat(),
                    **({"judgements": judgements} if judgements else {})})
    path.parent.mkdir(parents=True, exist_ok=True)
    # the script's own file, replaced whole (a reader never sees half a file)
    write_text(path, json.dumps({"component": component, "claims": entries}, indent=1) + "\n", overwrite=True)
    return path


def find(component: str, owner: object | None = None, root: str | os.PathLike | None = None) -> Path | None:
    """The claims file of ``component``: ``root``'s, else in its plugin's package (``claims/<name>.json``), the
    checkout's ``docs/claims/``, or the installed zoo's copy of it; None when there is none."""
    if root is not None:
        candidates = [claims_path(component, root)]
    else:
        from zoo.components.resources import package_dirs

        candidates = [folder / "claims" / f"{component}.json" for folder in package_dirs(owner)] if owner else []
        candidates += [claims_path(component), Path(__file__).resolve().parents[1] / "_claims" / f"{component}.json"]
    return next((c for c in candidates if c.is_file()), None)


def load(component: str, root: str | os.PathLike | None = None, owner: object | None = None) -> list[dict]:
    """``component``'s recorded claims (``[]`` when none were measured)."""
    path = find(component, owner, root)
    if path is None:
        return []
    data = json.loads(path.read_text())
    entries = data.get("claims") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and set(FIELDS) <= set(e) for e in entries):
        raise ValueError(f"{path}: expected {{'component': ..., 'claims': [{{{', '.join(FIELDS)}}}, ...]}}")
    return entries


def card_section(component) -> str:
    """The "Does the paper's claim hold here?" section of a component's card: every recorded verdict, or, for a
    component that cites a paper, that it has not been measured here."""
    entries = load(component.name, owner=component) if getattr(component, "name", "") else []
    if not entries:
        if not getattr(component, "paper", ""):
            return ""
        return "#### Does the paper's claim hold here?\nNot measured on the zoo's models yet.\n"
    lines = ["#### Does the paper's claim hold here?"]
    for e in entries:
        lines.append(f"- **{e['claim']}**: **{e['verdict']}**. {e['summary']} ({e['model']}; `{e['command']}`"
                     + (f", commit {e['commit']}" if e.get("commit") else "") + f", {e['date']})")
        for name, j in (e.get("judgements") or {}).items():
            lines.append(f"  - {name}: {j['verdict']}, margin {_cell(j['margin'])} vs noise {_cell(j['noise'])} "
                         f"over {j['repeats']} {'paired draws' if j.get('paired') else 'seeds'} ({j['reason']})")
        rows = e["numbers"] if isinstance(e["numbers"], list) else []
        if rows and all(isinstance(r, dict) for r in rows):
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["", "  | " + " | ".join(keys) + " |", "  |" + "---|" * len(keys)]
            lines += ["  | " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def readme_table(root: str | os.PathLike | None = None) -> str:
    """One Markdown table of every recorded claim: component, claim, verdict, model."""
    folder = claims_path("x", root).parent
    rows = ["| component | claim | verdict | model |", "|---|---|---|---|"]
    for path in sorted(folder.glob("*.json")):
        for e in load(path.stem, root):
            rows.append(f"| `{path.stem}` | {e['claim']} | {e['verdict']} | {e['model']} |")
    return "\n".join(rows) + "\n"


README_MARKERS = ("<!-- claims table: python -m zoo.evaluation.claims --readme -->", "<!-- end of claims table -->")


def write_readme(path: str | os.PathLike | None = None) -> None:
    """Replace the table between the README's claims markers with ``readme_table()``."""
    path = Path(path) if path is not None else Path(__file__).resolve().parents[2] / "README.md"
    text = path.read_text()
    start, end = (text.index(marker) for marker in README_MARKERS)
    write_text(path, text[:start + len(README_MARKERS[0])] + "\n" + readme_table() + text[end:], overwrite=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--readme"]:
        write_readme()
    else:
        print(readme_table(), end="")
