"""The block benchmark runs end to end at a smoke size (its numbers are not asserted: this machine is noisy)."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "moe_block.py"


def test_moe_block_benchmark_smoke():
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    table = [line for line in run.stdout.splitlines() if line.strip().startswith(("1 ", "16 "))]
    assert len(table) == 4, run.stdout  # T in {1, 16} x {fp32, bf16}
    assert "zoo target ratio" in run.stdout
