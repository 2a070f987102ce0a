"""Every benchmark that records claims has a quick mode (``--quick``: a tiny budget, 2 repeats, nothing recorded)
that runs end to end in the suite and prints each claim's verdict the way ``claim_args.conclude`` does: a head line
"<claim>: <verdict>" whose verdict is ``combine`` of the judged parts under it, each part as the one rule
(``zoo.evaluation.claims.judge``) decided it. Numbers are not asserted: a quick run is a smoke test of the path.

The scripts run one after another in one fresh process (``run_quick_modes`` below: each as ``__main__``, its own
output captured), which pays the imports once instead of once per script."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERDICT = r"(holds|holds in part|does not hold|inconclusive)"
HEAD = re.compile(rf"^(?P<label>\S.*): {VERDICT}$")
PART = re.compile(rf"^  - (?P<name>.+): {VERDICT}, margin \S+ vs noise \S+ over [2-9] "
                  rf"(paired draws|seeds|seeds, paired by seed|calibration draws) \((?P<reason>.+)\)$")
# these have their own quick tests, which assert more (tests/test_quantize_claims_quick.py,
# tests/test_multimodal_claim_quick.py); offload.py has no quick mode: its --smoke run takes ~8 minutes (a fresh
# process per row, compiled steps), so its engine is what is tested (tests/test_offload.py)
OWN_TESTS = {"quantize_claims.py", "quantize_formats_claims.py", "multimodal.py", "offload.py"}
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--quick"]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 1
            traceback.print_exc(file=err)
    results[path] = {"rc": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-4000:]}
print(json.dumps(results))
"""


def recording_scripts() -> list[str]:
    def records(text: str) -> bool:
        return ("from zoo.evaluation.claims import" in text or "from zoo.evaluation import claims" in text) \
            and "record(" in text

    return sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                  if records(p.read_text()) and p.name not in OWN_TESTS and p.name != "claim_args.py")


def claims_files() -> dict:
    return {p.name: p.read_bytes() for p in sorted((ROOT / "docs" / "claims").glob("*.json"))}


@pytest.fixture(scope="module")
def quick_runs():
    """{script: {rc, stdout, stderr}} of every recording script's ``--quick`` run, and whether docs/claims changed."""
    before = claims_files()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    scripts = [str(ROOT / "benchmarks" / s) for s in recording_scripts()]
    run = subprocess.run([sys.executable, "-c", DRIVER, *scripts], capture_output=True, text=True, timeout=1500,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    results = {Path(k).name: v for k, v in json.loads(run.stdout.splitlines()[-1]).items()}
    return results, claims_files() == before


def verdict_blocks(stdout: str) -> dict:
    """{head label: (verdict, [part verdicts])} of every verdict block in a quick run's output."""
    from zoo.evaluation.claims import combine

    lines, blocks = stdout.splitlines(), {}
    for i, line in enumerate(lines):
        head = HEAD.match(line)
        if not head:
            continue
        parts = []
        for nxt in lines[i + 1:]:
            m = PART.match(nxt)
            if not m:
                break
            parts.append(m.group(2))
        if parts:
            assert head.group(2) == combine(parts), f"{line!r} is not combine({parts})"
            blocks[head.group("label")] = (head.group(2), parts)
    return blocks


def test_the_recording_scripts_are_found():
    found = recording_scripts()
    assert "merging.py" in found and "claims_routers.py" in found and len(found) >= 15, found


@pytest.mark.parametrize("script", recording_scripts())
def test_quick_mode_prints_the_rules_verdicts(script, quick_runs):
    run = quick_runs[0][script]
    assert run["rc"] == 0, run["stderr"]
    assert verdict_blocks(run["stdout"]), f"{script} printed no judged verdict:\n{run['stdout'][-3000:]}"
    assert "nothing recorded" in run["stdout"], run["stdout"][-2000:]


def test_quick_runs_record_nothing(quick_runs):
    assert quick_runs[1], "a quick run wrote into docs/claims"
