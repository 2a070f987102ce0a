"""The block benchmark runs end to end at a smoke size (its numbers are not asserted: this machine is noisy)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "moe_block.py"


def test_moe_block_benchmark_smoke():
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    table = [line for line in run.stdout.splitlines() if line.strip().startswith(("1 ", "16 "))]
    assert len(table) == 4, run.stdout  # T in {1, 16} x {fp32, bf16}
    assert "zoo target ratio" in run.stdout


def test_decode_benchmark_smoke():
    script = SCRIPT.parent / "decode.py"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--threads", "1"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("mixtral-smoke ")]
    engines = ["transformers eager", "transformers grouped_mm", "zoo bf16 eager", "zoo int4 compiled"]
    assert [e for e in engines if any(e in r for r in rows)] == engines, run.stdout
    assert all(r.split()[-4] == "yes" for r in rows[:3]), run.stdout  # bf16 engines: same greedy tokens
    assert "machine read bandwidth" in run.stdout and all(float(r.split()[-2]) > 0 for r in rows), run.stdout


def kernel_benchmark_smoke(name: str):
    """A kernel benchmark's smoke run, one thread: its output, or None where the kernel is unavailable (the script
    then says so and exits cleanly)."""
    from zoo.moe import kernels

    run = subprocess.run([sys.executable, str(SCRIPT.parent / name), "--smoke", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if not kernels.load():
        assert "unavailable" in run.stdout
        return None
    return run.stdout


def test_moe_gemv_benchmark_smoke():
    """The kernel's bandwidth table: a row per stored form beside the machine's read bandwidth (or the reason it is
    absent)."""
    from zoo.moe import kernels

    out = kernel_benchmark_smoke("moe_gemv.py")
    if out is None:
        return
    assert "machine read bandwidth (a smoke run's stand-in: an eager fp32 sum" in out
    forms = [line.split()[0] for line in out.splitlines() if line.startswith(("bf16 ", "int"))]
    dot = kernels.best_isa() in kernels.INT8_DOT_ISAS  # the 8-bit-input rows, where they can run
    want = ["bf16", *(f for b in (8, 4, 3, 2) for f in [f"int{b}", *([f"int{b},"] if dot else [])])]
    assert forms == want, out


def test_moe_gemv_shapes_benchmark_smoke():
    """The shapes table: a row per projection, a share of the bandwidth per stored form (and 8-bit-input form where
    the set has them), each positive, the lowest of them at the row's end."""
    from zoo.moe import kernels

    out = kernel_benchmark_smoke("moe_gemv_shapes.py")
    if out is None:
        return
    header = next(line for line in out.splitlines() if line.startswith("model "))
    dot = kernels.best_isa() in kernels.INT8_DOT_ISAS
    forms = ["bf16", *(f for b in (8, 4, 3, 2) for f in [f"int{b}", *([f"int{b} x8"] if dot else [])])]
    assert re.findall(r"int\d x8|int\d|bf16", header.split("bf16 MB")[1]) == forms, header
    rows = [line.split() for line in out.splitlines() if line.startswith("smoke ")]
    assert [(r[1], r[2] + r[3]) for r in rows] == [("gate_up", "[256,128]"), ("down", "[128,320]")], out
    shares = [[float(v) for v in r[5:5 + len(forms)]] for r in rows]
    assert all(v > 0 for row in shares for v in row), out
    assert [float(r[5 + len(forms)]) for r in rows] == [min(row) for row in shares], out


def test_moe_gemv_shapes_benchmark_names_unknown_models():
    """A misspelt model: one line naming it, the close match and the known names, before any work."""
    run = subprocess.run([sys.executable, str(SCRIPT.parent / "moe_gemv_shapes.py"), "--models", "olmoe,mixtrl"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == "" and run.stderr == (
        "unknown model 'mixtrl' (did you mean mixtral?); known: deepseek-v3, gpt-oss, mixtral, olmoe, qwen-moe, "
        "qwen3-moe\n"), run.stderr


def test_stored_codes_benchmark_smoke():
    """The stored-codes table: a row per (width, inputs) with both arms' times, where the kernel is available."""
    from zoo.moe import kernels

    out = kernel_benchmark_smoke("stored_codes.py")
    if out is None:
        return
    rows = [line.split("|") for line in out.splitlines() if line.lstrip().startswith(("2 ", "3 "))]
    dot = kernels.best_isa() in kernels.INT8_DOT_ISAS
    assert [r[0].split() for r in rows] == [[b, i] for b in "23" for i in ("exact", "int8")[:1 + dot]], out
    assert all(r[4].strip() in ("yes", "no") for r in rows), out  # tokens compared (bf16: they may differ)
    assert all(float(r[1].split()[0]) > 0 and float(r[1].split()[2]) > 0 for r in rows), out


def test_moe_gemv_benchmark_switches_the_kernel_settings_once_a_round_and_restores_them(monkeypatch):
    """moe_gemv.py's rows time the kernel's calls alone: a row's settings (instruction set, 8-bit inputs) are on for
    each of its calls and switched once a round, not around each call; afterwards, or after a call that raised, the
    settings are those before; the eviction runs before each function's round."""
    from zoo.moe import kernels

    if not kernels.load():
        return
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import moe_gemv

    isa = kernels.best_isa()
    dot = isa in kernels.INT8_DOT_ISAS
    original = kernels.isa(), kernels.int8_inputs()
    before = kernels.isa("portable"), kernels.int8_inputs(False)
    switches, seen = [], []
    real_isa = kernels.isa

    def counting_isa(want=None):
        switches.append(want)
        return real_isa(want)

    def call(i):
        seen.append((real_isa(), kernels.int8_inputs()))
        if i < 0:
            raise RuntimeError("planted")

    monkeypatch.setattr(kernels, "isa", counting_isa)
    try:
        row = moe_gemv.with_int8_inputs(isa, call) if dot else moe_gemv.with_isa(isa, call)
        assert row.round(5) > 0
        assert seen == [(isa, dot)] * 5
        assert [w for w in switches if w is not None] == [isa, "portable"]  # on once, back once
        assert (real_isa(), kernels.int8_inputs()) == before
        seen.clear()
        row(0)
        assert seen == [(isa, dot)] and (real_isa(), kernels.int8_inputs()) == before
        with pytest.raises(RuntimeError, match="planted"):
            row(-1)
        assert (real_isa(), kernels.int8_inputs()) == before
        evictions = []
        assert moe_gemv.clock([row, lambda i: None], 3, repeats=2, between=lambda: evictions.append(len(seen)))[0] > 0
        assert len(seen) == 2 + 1 + 2 * 3
        assert evictions == [3, 6, 6, 9]  # before each function's round, untimed
    finally:
        real_isa(original[0])
        kernels.int8_inputs(original[1])
