"""Run the whole vendored transformers suite (native and zoo, every family) and write RESULTS.md from it.

    .venv/bin/python tests/transformers_suite/report.py              # run pytest, then write RESULTS.md
    .venv/bin/python tests/transformers_suite/report.py --junit X.xml  # only write RESULTS.md from a JUnit XML
    .venv/bin/python tests/transformers_suite/report.py -o -          # print instead of writing RESULTS.md
    .venv/bin/python tests/transformers_suite/report.py --time-default  # also time the default subset

The run is pytest with ``--junitxml`` over ``tests/transformers_suite`` with ``MOE_ZOO_FULL_TRANSFORMERS=1`` (every
test, not only the default subset). The table counts, per family and variant, passed / failed (failures and errors)
/ skipped tests and the time they took (JUnit per-test durations: setup + call + teardown). The list names each test
that fails on the zoo classes while the same test passes on the native ones, with the first line of its error, then
the other differences (a test that skips itself on one variant only, ...) and any failure on native.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
VARIANTS = ["native", "zoo"]
_CLASS = re.compile(r"\.test_(?P<family>[a-z0-9_]+)\.Test[A-Za-z0-9]+(?P<variant>Native|Zoo)$")


def run_pytest(junit: Path, extra: list[str], full: bool = True) -> tuple[int, float]:
    env = {**os.environ, "MOE_ZOO_FULL_TRANSFORMERS": "1" if full else "0", "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE.relative_to(ROOT)),
           f"--junitxml={junit}", *extra]
    start = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    return rc, time.monotonic() - start


def first_line(text: str | None) -> str:
    """The error's first non-empty line; when it only announces a list (ends with ':'), the list's first line too."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return ""
    out = lines[0]
    if out.endswith(":") and len(lines) > 1:
        out = f"{out} {lines[1]}"
    return out[:400]


def parse(junit: Path):
    """{(family, variant): {test name: (outcome, seconds, first error line)}}"""
    results: dict[tuple[str, str], dict] = defaultdict(dict)
    for case in ET.parse(junit).getroot().iter("testcase"):
        m = _CLASS.search(case.get("classname", ""))
        if not m:
            continue
        key = (m["family"], m["variant"].lower())
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = first_line(child.get("message")) or first_line(child.text)
                break
            if child.tag == "skipped":
                outcome = "skipped"
                message = first_line(child.get("message"))
        results[key][case.get("name")] = (outcome, float(case.get("time") or 0), message)
    return results


def render(results, wall: float | None, source: str, default_wall: float | None = None) -> str:
    import torch
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# transformers' model tests: native vs zoo",
        "",
        f"Generated {now} by `tests/transformers_suite/report.py` from {source}; do not edit by hand.",
        f"transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, device: CPU.",
        "",
        "Counts per family and variant (failed = failures + errors; skipped includes `skips.py` entries and "
        "tests that skip themselves: GPU, flash-attention, deepspeed, slow, ...). Time: sum of the tests' durations.",
        "",
        "| family | native passed | native failed | native skipped | native time | zoo passed | zoo failed "
        "| zoo skipped | zoo time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    totals = defaultdict(float)
    for family in FAMILIES:
        row = [family]
        for variant in VARIANTS:
            tests = results.get((family, variant), {})
            counts = {o: sum(1 for v in tests.values() if v[0] == o) for o in ("passed", "failed", "skipped")}
            seconds = sum(v[1] for v in tests.values())
            for o in ("passed", "failed", "skipped"):
                totals[(variant, o)] += counts[o]
            totals[(variant, "time")] += seconds
            row += [str(counts["passed"]), str(counts["failed"]), str(counts["skipped"]), f"{seconds:.0f} s"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| **all** | " + " | ".join(
        f"**{int(totals[(v, o)])}**" if o != "time" else f"**{totals[(v, o)]:.0f} s**"
        for v in VARIANTS for o in ("passed", "failed", "skipped", "time")) + " |")
    if wall is not None:
        lines += ["", f"Wall time of the whole run (collection included): {wall:.0f} s."]
    if default_wall is not None:
        lines += ["", f"Wall time of the default subset (what plain `pytest` runs here, both variants, every family; "
                      f"collection included): {default_wall:.0f} s."]

    zoo_only, both = [], []
    for family in FAMILIES:
        native = results.get((family, "native"), {})
        for name, (outcome, _, message) in sorted(results.get((family, "zoo"), {}).items()):
            if outcome != "failed":
                continue
            native_outcome = native.get(name, ("absent",))[0]
            (zoo_only if native_outcome == "passed" else both).append((family, name, native_outcome, message))
    lines += ["", f"## Fails on zoo, passes on native ({len(zoo_only)})", ""]
    lines += [f"- `{f}` `{n}`: {m or '(no message)'}" for f, n, _, m in zoo_only] or ["None."]
    lines += ["", f"## Fails on zoo, not passing on native either ({len(both)})", ""]
    lines += [f"- `{f}` `{n}` (native: {o}): {m or '(no message)'}" for f, n, o, m in both] or ["None."]
    others = []
    for family in FAMILIES:
        native, zoo_results = results.get((family, "native"), {}), results.get((family, "zoo"), {})
        for name in sorted(set(native) | set(zoo_results)):
            a, b = native.get(name, ("absent", 0, "")), zoo_results.get(name, ("absent", 0, ""))
            if a[0] != b[0] and b[0] != "failed" and not b[2].startswith("skips.py"):
                why = b[2] if b[0] == "skipped" else a[2]
                others.append(f"- `{family}` `{name}`: native {a[0]}, zoo {b[0]}" + (f" ({why})" if why else ""))
    lines += ["", f"## Other outcome differences, not from `skips.py` ({len(others)})", ""]
    lines += others or ["None."]
    native_failed = [(f, n, v[2]) for f in FAMILIES for n, v in sorted(results.get((f, "native"), {}).items())
                     if v[0] == "failed"]
    lines += ["", f"## Fails on native ({len(native_failed)})", ""]
    lines += [f"- `{f}` `{n}`: {m or '(no message)'}" for f, n, m in native_failed] or ["None."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="existing JUnit XML of a run of this suite (skips running pytest)")
    parser.add_argument("-o", "--output", default=str(HERE / "RESULTS.md"), help="file to write, '-' for stdout")
    parser.add_argument("--time-default", action="store_true",
                        help="also run the default subset (as `make test` does) and record its wall time")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    wall, rc, default_wall = None, 0, None
    if args.time_default:
        _, default_wall = run_pytest(Path(tempfile.mkdtemp()) / "default.xml", args.pytest_args, full=False)
    if args.junit:
        junit, source = args.junit, f"`{args.junit.name}`"
    else:
        junit = Path(tempfile.mkdtemp()) / "transformers_suite.xml"
        rc, wall = run_pytest(junit, args.pytest_args)
        source = "a full run (`MOE_ZOO_FULL_TRANSFORMERS=1`)"
    text = render(parse(junit), wall, source, default_wall)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    return 0 if rc in (0, 1) else rc


if __name__ == "__main__":
    sys.exit(main())
