"""Offloaded decode under a memory limit: the zoo's experts in place within a 25% budget against llama.cpp's mmap,
each process held by the system to the memory a 25% cache gives it (a memory cgroup), on the same weights.

    sudo python benchmarks/offload_limited.py --llama-cpp-path /tmp/llamacpp4     # the 304M model, minutes
    sudo python benchmarks/offload_limited.py --storage bf16 --smoke              # tiny shapes

``benchmarks/offload.py`` runs every engine with all the memory it wants: there llama.cpp's mmap keeps the whole
file's pages mapped, where the zoo's budget holds a quarter of the experts. Here every row runs in a fresh child
process placed, before it starts, in a new memory cgroup of its own, the page cache dropped first
(``/proc/sys/vm/drop_caches``) so that the file pages the row reads are charged to it and not to whatever read them
before. Each engine runs once unconstrained, every expert mapped (its peak charge: RSS, the page cache it read,
kernel memory; ``--rule rss``: its peak RSS), then limited to that peak less 75% of the experts' bytes: the memory
its own working set and a quarter of the experts take. What does not fit, the system reclaims (file pages first:
they can be read again). Pages another process maps (the parent's torch libraries) are charged to that process,
alike for every row.

Rows, per storage (bf16 experts, the zoo's int4 codes; llama.cpp's GGUF of the same weights, Q4_1 for int4):
llama.cpp's mmap, the zoo in place with no budget and within a 25% budget, unconstrained and then at their engine's
limit (the budgeted row at the zoo's); and llama.cpp at the zoo's limit (one absolute amount of memory for both
engines). The zoo decodes eagerly (``greedy(..., compile=False)``), or with its compiled step (``--compiled``: the
compile's own memory then counts against the limit too); tok/s as in ``benchmarks/offload.py``, whose ``--worker``
runs each row.

Needs Linux, root (drop_caches) and a memory cgroup this process may create children in (cgroup v1, or v2 with the
memory controller enabled for children); says which is missing otherwise. Drops the whole system's page cache once
per row: run it on a machine doing nothing else. Records nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHED_SHARE = 0.25
MB = 1 << 20  # as benchmarks/offload.py reports RSS


class MemoryCgroup:
    """A child memory cgroup of this process's own (v1 ``memory`` hierarchy or v2 unified), removed on exit."""

    def __init__(self, name: str, limit: int | None):
        self.root, self.v2 = own_memory_cgroup()
        self.path = self.root / name
        self.limit = limit

    def __enter__(self):
        self.path.mkdir()
        if self.limit is not None:
            (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(self.limit))
        return self

    def enter(self) -> None:
        """Moves the calling process in (a child's ``preexec_fn``: everything it then maps is charged here)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_and_failures(self) -> tuple[int, int]:
        if self.v2:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            return int((self.path / "memory.peak").read_text()), int(events.get("max", 0))
        return (int((self.path / "memory.max_usage_in_bytes").read_text()),
                int((self.path / "memory.failcnt").read_text()))

    def __exit__(self, *exc):
        try:
            self.path.rmdir()
        except OSError:
            pass


def own_memory_cgroup(listing: str | None = None) -> tuple[Path, bool]:
    """(this process's memory cgroup folder, whether it is cgroup v2), from ``/proc/self/cgroup`` (or ``listing``)."""
    lines = (Path("/proc/self/cgroup").read_text() if listing is None else listing).splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), False
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), True
    raise RuntimeError("this process is in no memory cgroup")


def why_not_limitable() -> str | None:
    """None when this process can run rows in memory cgroups of their own, else one line saying why not."""
    if not sys.platform.startswith("linux"):
        return "memory cgroups are Linux's"
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "dropping the page cache needs root (/proc/sys/vm/drop_caches is not writable)"
    try:
        root, v2 = own_memory_cgroup()
    except (OSError, RuntimeError) as exc:
        return f"no memory cgroup found ({exc})"
    if v2 and "memory" not in (root / "cgroup.subtree_control").read_text().split():
        return f"cgroup v2 without the memory controller enabled for children of {root}"
    try:
        with MemoryCgroup(f"zoo-probe-{os.getpid()}", 1 << 40):
            pass
    except OSError as exc:
        return f"cannot create a memory cgroup under {root} ({exc.strerror})"
    return None


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")


def run_row(spec: dict, llama_path: str | None, limit: int | None) -> dict:
    """``spec`` run by ``benchmarks/offload.py --worker`` in a fresh process in a memory cgroup of its own, limited to
    ``limit`` bytes (None: unlimited, its charges measured), the page cache dropped first."""
    env = dict(os.environ)
    if spec["engine"] == "llama.cpp" and llama_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (llama_path, env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(HERE / "offload.py"), "--worker", json.dumps(spec)]
    drop_page_cache()
    with MemoryCgroup(f"zoo-row-{os.getpid()}", limit) as group:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=group.enter)
        usage = group.peak_and_failures()
    if proc.returncode != 0:
        killed = proc.returncode == -9 or "MemoryError" in proc.stderr
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"failed": "killed: out of memory" if killed else last[:80]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["cgroup_peak_mb"], row["reclaim_failures"] = usage[0] / MB, usage[1]
    return row


def expert_bytes(folder: Path) -> int:
    """Bytes of the experts' tensors in a zoo checkpoint (every tensor of a ``.experts.`` module)."""
    from zoo.io.checkpoint import checked_weight_map, shard_header

    total = 0
    for file in set(checked_weight_map(folder).values()):
        _, header = shard_header(file)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                     if k != "__metadata__" and ".experts." in k)
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--llama-cpp-path", default="/tmp/llamacpp4", help="a folder to import llama_cpp from ('' none)")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per limited row")
    ap.add_argument("--storage", choices=("bf16", "int4", "both"), default="both")
    ap.add_argument("--layers", type=int, default=4, help="the model's depth (4: the 304M model; 16: 2.1 GB of bf16 "
                    "experts, 4x the zoo's own memory)")
    ap.add_argument("--compiled", action="store_true", help="the zoo's rows with its compiled step")
    ap.add_argument("--rule", choices=("charge", "rss"), default="charge", help="an engine's peak memory: what its "
                    "cgroup was charged (RSS, page cache read, kernel memory) or its peak RSS (VmHWM)")
    args = ap.parse_args(argv)
    why = why_not_limitable()
    if why:
        sys.exit(f"offload_limited: cannot limit memory here: {why}")
    sys.path.insert(0, str(HERE))
    import torch

    from offload import llama_cpp_available, write_checkpoints

    why_llama = llama_cpp_available(args.llama_cpp_path)
    if why_llama:
        sys.exit(f"offload_limited: llama.cpp does not import: {why_llama}")
    if args.smoke:
        args.new_tokens = 6
    prompt = torch.randint(3, 8192, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-offload-limited-") as tmp:
        stores = write_checkpoints(Path(tmp), args.smoke, gguf=True, layers=args.layers)
        for storage, (folder, gguf) in stores.items():
            if args.storage not in ("both", storage):
                continue
            experts = expert_bytes(folder)
            total = sum(entry["num_experts"] for entry in json.loads((folder / "config.json").read_text())["zoo_layout"]
                        if entry)
            common = {"folder": str(folder), "threads": args.threads, "prompt": prompt, "new_tokens": args.new_tokens}
            step = {"compiled": args.compiled}
            budget = round(total * CACHED_SHARE)
            engines = {"llama.cpp mmap": {"engine": "llama.cpp", "gguf": str(gguf), **common},
                       "zoo in place": {"engine": "in-place", **step, **common},
                       f"zoo in place, budget {CACHED_SHARE:.0%} ({budget}/{total})":
                           {"engine": "in-place", "cache_experts": budget, **step, **common}}
            peaks = {}
            for name, spec in engines.items():
                r = run_row({**spec, "label": name}, args.llama_cpp_path, None)
                peaks[name] = r.get("cgroup_peak_mb" if args.rule == "charge" else "peak_mb")
                rows.append({"storage": storage, "engine": name, "limit_mb": None, **r})
                print(f"  {storage}: {name}, unconstrained: {r.get('decode', float('nan')):.1f} tok/s", flush=True)
            # each engine's limit from its own peak charge with every expert mapped (the budgeted row gets the zoo's)
            limits = {name: None if peaks[key] is None else peaks[key] - (1 - CACHED_SHARE) * experts / MB
                      for name, key in zip(engines, ("llama.cpp mmap", "zoo in place", "zoo in place"))}
            runs = [(name, limits[name], "own") for name in engines] + [("llama.cpp mmap", limits["zoo in place"],
                                                                          "the zoo's")]
            for name, limit, rule in runs:
                for repeat in range(args.repeats if limit is not None else 0):
                    r = run_row({**engines[name], "label": name}, args.llama_cpp_path, int(limit * MB))
                    rows.append({"storage": storage, "engine": name, "limit_mb": limit, "rule": rule, **r})
                    print(f"  {storage}: {name}, limited to {limit:.0f} MB ({rule}) #{repeat + 1}: "
                          f"{r.get('decode', float('nan')):.1f} tok/s", flush=True)
            rows.append({"storage": storage, "experts_mb": experts / MB})
    report(rows, args)


def report(rows: list[dict], args) -> None:
    print(f"\n{args.new_tokens} greedy tokens after a {args.prompt}-token prompt, batch 1, {args.threads} threads; "
          f"{'mixtral-smoke' if args.smoke else 'Mixtral-shaped'}, {args.layers} layers x 8 experts, top-2; "
          f"every row a fresh process; the zoo {'compiled' if args.compiled else 'eager'}")
    head = (f"{'experts':8} {'engine':34} {'limit MB':>8} {'rule':>9} {'decode tok/s':>12} {'peak RSS MB':>11} "
            f"{'cgroup peak MB':>14} {'limit hits':>10} {'same tokens':>11}")
    print(head + "\n" + "-" * len(head))
    free = {}
    for r in rows:
        if "experts_mb" in r:
            print(f"{r['storage']:8} (experts: {r['experts_mb']:.0f} MB; the own rule: the engine's unconstrained "
                  f"{'cgroup peak' if args.rule == 'charge' else 'peak RSS'} less {1 - CACHED_SHARE:.0%} of them)")
            continue
        if r["limit_mb"] is None and "tokens" in r:
            free.setdefault((r["storage"], r["engine"].split(",")[0]), r)
        ref = free.get((r["storage"], "zoo in place"))
        same = "-" if "tokens" not in r or ref is None or r["engine"].startswith("llama") else (
            "yes" if r["tokens"] == ref["tokens"] else "no")
        limit = "none" if r["limit_mb"] is None else f"{r['limit_mb']:.0f}"
        speed = f"{r['decode']:12.1f}" if "decode" in r else f"{r['failed']:>12}"
        cg = f"{r['cgroup_peak_mb']:14.0f}" if "cgroup_peak_mb" in r else f"{'-':>14}"
        hits = f"{r['reclaim_failures']:10d}" if "reclaim_failures" in r else f"{'-':>10}"
        print(f"{r['storage']:8} {r['engine']:34} {limit:>8} {r.get('rule', '-'):>9} {speed} "
              f"{r.get('peak_mb', float('nan')):11.0f} {cg} {hits} {same:>11}")
    limited = {}
    for r in rows:
        if r.get("rule") == "own" and "decode" in r:
            limited.setdefault((r["storage"], r["engine"]), []).append(r["decode"])
    for storage in sorted({s for s, _ in limited}):
        ours = next((v for (s, e), v in limited.items() if s == storage and "budget" in e), None)
        theirs = limited.get((storage, "llama.cpp mmap"))
        if ours and theirs:
            print(f"{storage}: at its own limit, the zoo in place within a {CACHED_SHARE:.0%} budget decodes "
                  f"{statistics.median(ours):.1f} tok/s, llama.cpp's mmap {statistics.median(theirs):.1f}: "
                  f"{statistics.median(ours) / statistics.median(theirs):.2f}x")
    print("(peak RSS: the process's VmHWM, mapped file pages included; cgroup peak: the most its cgroup was charged,\n"
          " the page cache it read included; limit hits: how often a charge met the limit and the system reclaimed;\n"
          " same tokens: equal to the unconstrained zoo-in-place row's greedy tokens)")


if __name__ == "__main__":
    main()
