"""``benchmarks/multimodal.py --claim --quick`` runs end to end (2 seeds x 2 arms of 20 steps), prints one verdict per
MoHAVE claim that is ``combine`` of its parts as the one rule (``zoo.evaluation.claims.judge``) decided them, and
records nothing. The numbers are not asserted: 20 steps are a smoke test. Fast: about half a minute on one thread."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERDICT = r"(holds|holds in part|does not hold|inconclusive)"
# "  - <name>: <verdict>, margin <m> vs noise <n> over 2 seeds, paired by seed (<reason>)"
PART = re.compile(rf"^  - (?P<name>.+): {VERDICT}, margin \S+ vs noise \S+ over 2 seeds, paired by seed \((?P<reason>.+)\)$")
CLAIMS = {  # claim line prefix: number of judged parts
    "hierarchical-modality: the group-load biasing loss makes each expert group serve its modality": 2,
    "hierarchical-modality: with modality groups the model leans on the image when the audio is noisy": 1,
    "modality-groups: expert groups become modality-specific": 1,
}


def claims_files() -> dict:
    return {p.name: p.read_bytes() for p in sorted((ROOT / "docs" / "claims").glob("*.json"))}


def test_quick_claim_run_prints_combined_verdicts_and_records_nothing():
    from zoo.evaluation.claims import combine

    before = claims_files()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multimodal.py"), "--claim", "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for prefix, n_parts in CLAIMS.items():
        heads = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(heads) == 1, f"no verdict line for {prefix!r}:\n{run.stdout[-3000:]}"
        head = re.match(rf"^.+: {VERDICT}$", lines[heads[0]])
        assert head, lines[heads[0]]
        parts = [PART.match(line) for line in lines[heads[0] + 1:heads[0] + 1 + n_parts]]
        assert all(parts), f"{prefix!r} lacks its {n_parts} judged part(s):\n{run.stdout[-3000:]}"
        assert head.group(1) == combine(m.group(2) for m in parts), lines[heads[0]:heads[0] + 1 + n_parts]
    assert "nothing recorded" in run.stdout
    assert claims_files() == before, "a quick run wrote into docs/claims"
