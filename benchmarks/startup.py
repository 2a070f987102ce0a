"""Startup time: the median wall time of N fresh Python processes for each of

- ``import zoo`` (target 2 s) and ``moe-zoo --help`` / ``--version`` (target 1 s): nothing heavy is imported;
- ``import torch``: the floor any torch user pays, for comparison;
- first use, which pays for torch, transformers and the plugins: ``zoo.list_components()``, and
  ``AutoConfig.from_pretrained`` of a saved zoo config (made once in a temporary folder) after ``import zoo``.

    python benchmarks/startup.py             # 5 runs each
    python benchmarks/startup.py --runs 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False",
       "TQDM_DISABLE": "1"}
MAKE_CONFIG = """
import sys
import zoo
from zoo.testing import tiny_model
zoo.convert(tiny_model("mixtral")).config.save_pretrained(sys.argv[1])
"""


def moe_zoo() -> list[str]:
    script = shutil.which("moe-zoo", path=str(Path(sys.executable).parent)) or shutil.which("moe-zoo")
    return [script] if script else [sys.executable, "-m", "zoo.cli"]


def cases(config_dir: str) -> list[tuple[str, list[str], float | None]]:
    py = [sys.executable, "-c"]
    return [
        ("import zoo", py + ["import zoo"], 2.0),
        ("moe-zoo --help", moe_zoo() + ["--help"], 1.0),
        ("moe-zoo --version", moe_zoo() + ["--version"], 1.0),
        ("import torch (floor)", py + ["import torch"], None),
        ("first use: zoo.list_components()", py + ["import zoo; zoo.list_components()"], None),
        ("first use: AutoConfig.from_pretrained", py + [
            "import zoo; from transformers import AutoConfig; "
            f"assert AutoConfig.from_pretrained({config_dir!r}).model_type == 'zoo_mixtral'"], None),
    ]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per case (the median is reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", MAKE_CONFIG, tmp], check=True, env=ENV, capture_output=True)
        rows = []
        for name, cmd, target in cases(tmp):
            times = [timed(cmd) for _ in range(args.runs)]
            rows.append((name, statistics.median(times), min(times), max(times), target))
            print(f"  {name}: {statistics.median(times):.2f} s", file=sys.stderr, flush=True)
    print(f"\nmedian of {args.runs} fresh processes, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n")
    print(f"| {'what':38} | median s | min s | max s | target | ok  |")
    print(f"|{'-' * 40}|---------:|------:|------:|-------:|-----|")
    for name, median, low, high, target in rows:
        goal, ok = (f"{target:.0f} s", "yes" if median < target else "NO") if target else ("-", "")
        print(f"| {name:38} | {median:8.2f} | {low:5.2f} | {high:5.2f} | {goal:>6} | {ok:3} |")


if __name__ == "__main__":
    main()
