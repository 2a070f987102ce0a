"""The quantize claim benchmarks' quick modes run end to end, print the verdicts the one rule (``zoo.evaluation.claims.judge`` and
``combine``) gives, and record nothing (their numbers are not asserted: two windows per draw are a smoke test)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERDICT = r"(holds|holds in part|does not hold|inconclusive)"
# judgement_line: "<name>: <verdict>, margin <m> vs noise <n> over <k> paired draws (<reason>)"
PART = re.compile(rf"^  - (?P<name>.+): {VERDICT}, margin \S+ vs noise \S+ over 2 paired draws \((?P<reason>.+)\)$")


def claims_files() -> dict:
    return {p.name: p.read_bytes() for p in sorted((ROOT / "docs" / "claims").glob("*.json"))}


@pytest.mark.parametrize("script, claims, same", [
    ("quantize_formats_claims.py", ("FineQuant", "BitMoD"),
     # FineQuant's bound 0.6 gives every stack one group size on zoo-tiny-moe: the uniform run of that size
     "4b adaptive a=0.6"),
    ("quantize_claims.py", ("PMQ", "AlphaQ"),
     # at a whole-number budget AlphaQ allocates exactly like uniform
     "3b alphaq vs 3b uniform"),
])
def test_quick_mode_prints_the_rules_verdicts_and_records_nothing(script, claims, same):
    before = claims_files()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "TQDM_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--threads", "1"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for claim in claims:
        heads = [i for i, line in enumerate(lines) if re.match(rf"^{claim}: {VERDICT}( \(|$)", line)]
        assert len(heads) == 1, f"no verdict line for {claim}:\n{run.stdout[-3000:]}"
        parts = [PART.match(line) for line in lines[heads[0] + 1:]]
        parts = parts[:next((i for i, m in enumerate(parts) if m is None), len(parts))]
        assert parts, f"{claim}'s verdict has no judged comparison under it:\n{run.stdout[-3000:]}"
        # the claim's verdict is combine() of its parts' verdicts
        from zoo.evaluation.claims import combine

        assert re.match(rf"^{claim}: {re.escape(combine(m.group(2) for m in parts))}( \(|$)", lines[heads[0]])
    identical = [line for line in lines if line.startswith(f"  - {same}")]
    assert identical and "inconclusive" in identical[0] and "the arms are the same model" in identical[0], run.stdout
    assert "nothing recorded" in run.stdout
    assert claims_files() == before, "a quick run wrote into docs/claims"
