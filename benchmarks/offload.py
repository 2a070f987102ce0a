"""Expert offloading (``zoo.offload``): decode tok/s and peak RSS of a model whose experts stay in the checkpoint,
against the same checkpoint in memory and against llama.cpp memory-mapping the zoo's GGUF export of the same
weights. One table, one run.

    python benchmarks/offload.py                  # the Mixtral-shaped 304M model of benchmarks/decode.py
    python benchmarks/offload.py --smoke          # tiny shapes, seconds
    python benchmarks/offload.py --llama-cpp-path /tmp/llamacpp4   # where llama_cpp is importable from
    python benchmarks/offload.py --repeats 3      # each zoo row in 3 fresh processes (the noise the verdict uses)
    python benchmarks/offload.py --eager-only --storage bf16   # the eager rows only (no compiled step, no llama.cpp), minutes

The run records its verdict in docs/claims/offload.json (``--no-record``: print only; a ``--smoke`` run never
records) under the claims' one rule (``zoo.evaluation.claims.judge``): the memory part compares the offloaded model with a 25%
cache against the same checkpoint in memory (peak RSS above the imports, lower is better), the compression part
int4 experts against bf16 experts, both offloaded with a 25% cache (decode tok/s, higher is better); each row's
repeats in fresh processes give the noise. FloE's other parts (activation sparsity, its channel predictors) are
not built, so they are not claimed; its prefetch (``prefetch=True``) is shown beside the cache rows, not judged.

The checkpoint is written twice: bf16 experts, and the zoo's packed int4 experts (``quantize``, bits=4: FloE's
premise, experts stored compressed so that a miss reads fewer bytes). Every row runs in a fresh child process, so
its peak RSS (VmHWM) is its own; "start" is the child's RSS after its imports, before the model; its file is
dropped from the page cache first, so its warm-up reads it as a model streamed from disk is read. Rows:
the checkpoint in memory (``zoo.load``), offloaded with a cache of 50% and 25% of the experts (all layers
together), each also with the reader thread on (``prefetch=True``: it reads the routed experts the cache lacks and
those the next layer's router picks for this layer's input while the layer computes) and in place within the same
budget (``reader="in-place", cache_experts=...``: the experts computed where they lie in the mapped file, the least
recently used beyond the budget given back to the system, no copies; eager, and with the compiled step; the 25%
budget compiled also on a fresh copy of the checkpoint, written back but left in the page cache in the folios the
copy's writes made, where a layer's first miss drops its expert tensors' pages to read them again in 2 MB
folios), and
llama.cpp with mmap (its default) on the GGUF of the same weights (bf16; the zoo's int4 codes as Q4_1). The zoo rows
decode eagerly (``zoo.runtime.decode.greedy(..., compile=False)``: the cache modes' experts cannot run inside a
compiled step) but those marked compiled (``greedy``'s default step, compiled ahead of time); llama.cpp runs its own
C++ loop.

Decode tok/s = (new tokens - 1) / (time of a full run - time of a 1-token run), after one warm-up run, median of
two pairs. Hits and misses count the timed runs (the warm-up's cold misses excluded).
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rss_mb(field: str = "VmHWM") -> float:
    """The process's peak (VmHWM) or current (VmRSS) resident set, MB. Not ``getrusage``'s ru_maxrss: Linux keeps
    that across fork and exec, so a child would start at its parent's peak; VmHWM belongs to the new image."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: kB here too (macOS: bytes)


# ------------------------------------------------------------------------------------------------ child processes
def worker(spec: dict) -> dict:
    """One row: load as ``spec`` says, decode, report speed, RSS and (offloaded) cache counts."""
    if spec["engine"] == "llama.cpp":
        return llama_worker(spec)
    import torch

    import zoo
    from zoo.runtime.decode import greedy
    from zoo.runtime.offloading import cache_of

    torch.set_num_threads(spec["threads"])
    start = rss_mb("VmRSS")
    t = time.perf_counter()
    if spec["engine"] == "memory":
        model = zoo.load(spec["folder"]).eval()
    elif spec["engine"] == "in-place":
        model = zoo.offload(spec["folder"], reader="in-place", cache_experts=spec.get("cache_experts"))
    else:
        model = zoo.offload(spec["folder"], cache_experts=spec["cache_experts"], prefetch=spec.get("prefetch", False))
    load_s = time.perf_counter() - t
    ids = torch.tensor([spec["prompt"]])
    n, compiled = spec["new_tokens"], spec.get("compiled", False)
    cache = cache_of(model) if spec["engine"] == "offload" or spec.get("cache_experts") is not None else None
    with torch.no_grad():
        greedy(model, ids, 1, compile=compiled)  # warm-up: fills the cache, compiles both lengths' steps
        out = greedy(model, ids, n, compile=compiled)
        speeds, counts = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            first = counted(cache, lambda: greedy(model, ids, 1, compile=compiled))
            t1 = time.perf_counter()
            full = counted(cache, lambda: greedy(model, ids, n, compile=compiled))
            t2 = time.perf_counter()
            speeds.append((n - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
            counts.append({k: (full[k] - first[k]) / (n - 1) for k in full})  # per decode token: full minus prefill
        out = greedy(model, ids, n, compile=compiled)
    row = {"decode": statistics.median(speeds), "load_s": load_s, "start_mb": start, "peak_mb": rss_mb(),
           "anon_mb": rss_mb("RssAnon"), "tokens": out[0, len(spec["prompt"]):].tolist()}
    if cache is not None:
        row["cache"] = {k: statistics.mean(c[k] for c in counts) for k in counts[0]}
        row["cache"]["resident_mb"] = cache.peak_resident / 1e6
    return row


def counted(cache, run) -> dict:
    """Hits, misses and bytes read by ``run()`` (nothing without a cache)."""
    if cache is None:
        run()
        return {}
    if cache.prefetcher is not None:
        cache.prefetcher.drain()  # the previous run's reads ahead are not this one's
    cache.reset_counts()
    run()
    return {"hits": cache.hits, "misses": cache.misses, "bytes_read": cache.bytes_read, "prefetched": cache.prefetched,
            "prefetch_used": cache.prefetch_used, "predicted_right": cache.predicted_right,
            "predicted_of": cache.predicted_of}


def llama_worker(spec: dict) -> dict:
    from llama_cpp import Llama

    start = rss_mb("VmRSS")
    t = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=256, n_batch=256, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t
    n, speeds = spec["new_tokens"], []
    for _ in range(3):  # the first: warm-up
        llm.reset()
        llm.eval(spec["prompt"])
        tokens = [llm.sample(top_k=1, temp=0.0)]
        t = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            tokens.append(llm.sample(top_k=1, temp=0.0))
        speeds.append((n - 1) / (time.perf_counter() - t))
    return {"decode": statistics.median(speeds[1:]), "load_s": load_s, "tokens": tokens, "start_mb": start,
            "peak_mb": rss_mb(), "anon_mb": rss_mb("RssAnon")}


def run_child(spec: dict, llama_path: str | None) -> dict:
    if spec.get("copied"):  # run on a fresh copy, its pages left in the page cache as the copy wrote them
        with tempfile.TemporaryDirectory(dir=Path(spec["folder"]).parent) as copy:
            return run_child({**spec, "folder": just_copied(Path(spec["folder"]), Path(copy)), "copied": False,
                              "cached": True}, llama_path)
    for file in ([spec["gguf"]] if spec["engine"] == "llama.cpp" else Path(spec["folder"]).glob("*.safetensors")):
        if not spec.get("cached"):
            out_of_page_cache(file)
    env = dict(os.environ)
    if spec["engine"] == "llama.cpp" and llama_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (llama_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"row {spec['label']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def just_copied(folder: Path, into: Path) -> str:
    """A copy of the checkpoint folder written as ``cp`` writes it (through the zoo's atomic saver, which writes each
    file back to the disk), its pages left in the page cache as the writes made them (4 KB folios on ext4): a
    checkpoint just downloaded or copied."""
    import shutil

    from zoo.io.atomic import atomic_directory

    copy = into / folder.name
    with atomic_directory(copy) as staging:
        for file in folder.iterdir():
            if file.is_file():
                shutil.copyfile(file, Path(staging) / file.name)
    return str(copy)


def out_of_page_cache(file) -> None:
    """Drops a file's pages from the system's page cache (``POSIX_FADV_DONTNEED``; nothing where the system lacks
    it), so that each row starts as a model streamed from disk does: its warm-up reads the file, and the system's
    readahead, not the checkpoint's writer, decides the size of the pages the file is cached in (2 MB pieces where a
    map asks for huge pages, as the zoo's in-place map does)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def llama_cpp_available(path: str | None) -> str | None:
    """None if ``llama_cpp`` imports (from ``path`` if given), else why not."""
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True, env=env)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["import failed"])[-1]


# ------------------------------------------------------------------------------------------------ the parent
def write_checkpoints(out: Path, smoke: bool, gguf: bool, layers: int = 4) -> dict:
    """{storage: (zoo folder, GGUF file or None)} for bf16 and int4 experts of one random model (``layers`` deep)."""
    import copy

    import zoo
    from decode import mixtral_shaped

    base = zoo.convert(mixtral_shaped(smoke, layers)).eval()
    int4 = zoo.apply(copy.deepcopy(base), "quantize", bits=4)
    tokenizer = zoo.load_tokenizer("zoo-tiny-moe")
    folders = {}
    for key, model in (("bf16", base), ("int4", int4)):
        folders[key] = out / key
        model.save_pretrained(folders[key])
        tokenizer.save_pretrained(folders[key])
    files = {}
    if gguf:
        from llama_cpp_rows import gguf_files

        files = gguf_files({"bf16": base, "int4": int4}, tokenizer, out)
    return {"bf16": (folders["bf16"], files.get("bf16")), "int4": (folders["int4"], files.get("Q4_1 experts"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--llama-cpp-path", default="/tmp/llamacpp4", help="a folder to import llama_cpp from ('' none)")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per zoo row (at least 2: the noise)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--eager-only", action="store_true", help="only the eager rows (in memory, offloaded with and "
                    "without prefetch, in place within a budget); never records")
    ap.add_argument("--storage", choices=("bf16", "int4", "both"), default="both", help="which experts' rows to run")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error("--repeats must be at least 2: one run has no noise to judge a verdict against")
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sys.path.insert(0, str(HERE))
    import torch

    from zoo.io.checkpoint import checkpoint_bytes

    if args.smoke:
        args.new_tokens = 6
    why_not = llama_cpp_available(args.llama_cpp_path)
    prompt = torch.randint(3, 8192, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-offload-") as tmp:
        stores = write_checkpoints(Path(tmp), args.smoke, gguf=why_not is None)
        for storage, (folder, gguf) in stores.items():
            if args.storage not in ("both", storage):
                continue
            cfg = json.loads((folder / "config.json").read_text())
            total = sum(entry["num_experts"] for entry in cfg["zoo_layout"] if entry)
            size = checkpoint_bytes(folder) / 1e6
            common = {"folder": str(folder), "threads": args.threads, "prompt": prompt, "new_tokens": args.new_tokens}
            specs = [{"label": "in memory", "engine": "memory", **common}]
            for share in (0.5, 0.25):
                for prefetch in (False, True):  # side by side: the same cache without and with the reader thread
                    specs.append({"label": f"offload{'+prefetch' if prefetch else ''}, cache {share:.0%} "
                                           f"({round(total * share)}/{total})", "engine": "offload",
                                  "cache_experts": round(total * share), "prefetch": prefetch, **common})
                specs.append({"label": f"in place, budget {share:.0%} ({round(total * share)}/{total})",
                              "engine": "in-place", "cache_experts": round(total * share), **common})
            if not args.eager_only:
                specs += [{"label": "in memory, compiled", "engine": "memory", "compiled": True, **common},
                          {"label": "in place (mapped), compiled", "engine": "in-place", "compiled": True, **common}]
                specs += [{"label": f"in place, budget {share:.0%} ({round(total * share)}/{total}), compiled",
                           "engine": "in-place", "cache_experts": round(total * share), "compiled": True, **common}
                          for share in (0.5, 0.25)]
                specs.append({"label": f"in place, budget 25% ({round(total / 4)}/{total}), compiled, copied",
                              "engine": "in-place", "cache_experts": round(total / 4), "compiled": True,
                              "copied": True, **common})
            if gguf is not None and not args.eager_only:
                specs.append({"label": "llama.cpp mmap" + (" (Q4_1)" if storage == "int4" else ""),
                              "engine": "llama.cpp", "gguf": str(gguf), **common})
            reference = {}  # eager and compiled steps each against their own in-memory tokens
            for spec in specs:
                for repeat in range(1 if spec["engine"] == "llama.cpp" else args.repeats):
                    r = run_child(spec, args.llama_cpp_path)
                    compiled = spec.get("compiled", False)
                    reference.setdefault(compiled, r["tokens"])
                    r.update(storage=storage, label=spec["label"], size_mb=size, repeat=repeat, compiled=compiled,
                             engine=spec["engine"], cache=r.get("cache"),
                             same=None if spec["engine"] == "llama.cpp" else r["tokens"] == reference[compiled])
                    rows.append(r)
                    print(f"  {storage}: {spec['label']} #{repeat + 1} done ({r['decode']:.1f} tok/s)", flush=True)
    print(f"\n{args.new_tokens} greedy tokens after a {args.prompt}-token prompt, batch 1, {args.threads} threads; "
          f"{'mixtral-smoke' if args.smoke else 'Mixtral-shaped 304M (4 layers x 8 experts, top-2)'}; "
          "each row a fresh process")
    head = (f"{'experts':8} {'ckpt MB':>7} {'engine':46} {'decode tok/s':>12} {'vs mem':>6} {'peak RSS MB':>11} "
            f"{'start MB':>8} {'peak-start':>10} {'anon MB':>7} {'cache MB':>8} {'load s':>6} {'hits/tok':>8} "
            f"{'misses/tok':>10} {'MB read/tok':>11} {'hit rate':>8} {'predictor':>9} {'same tokens':>11}")
    print(head + "\n" + "-" * len(head))
    eager = {st: statistics.median(r["decode"] for r in rows if r["storage"] == st and r["label"] == "in memory")
             for st in {r["storage"] for r in rows}}
    for r in rows:
        c = r.get("cache")
        ratio = "-" if r.get("compiled") or r["engine"] == "llama.cpp" else f"{r['decode'] / eager[r['storage']]:.2f}"
        looked = c and c["hits"] + c["misses"]
        rate = f"{c['hits'] / looked:.0%}" if looked else "-"
        guess = f"{c['predicted_right'] / c['predicted_of']:.0%}" if c and c.get("predicted_of") else "-"
        hit, miss, read, held = (("-",) * 4 if not c else (f"{c['hits']:.2f}", f"{c['misses']:.2f}",
                                 f"{c['bytes_read'] / 1e6:.1f}", f"{c['resident_mb']:.0f}"))
        same = "-" if r["same"] is None else "yes" if r["same"] else "no"
        print(f"{r['storage']:8} {r['size_mb']:7.0f} {r['label']:46} {r['decode']:12.1f} {ratio:>6} "
              f"{r['peak_mb']:11.0f} {r['start_mb']:8.0f} {r['peak_mb'] - r['start_mb']:10.0f} {r.get('anon_mb', float('nan')):7.0f} "
              f"{held:>8} {r['load_s']:6.1f} {hit:>8} {miss:>10} {read:>11} {rate:>8} {guess:>9} {same:>11}")
    print("(start: the process's RSS after its imports; anon MB: its anonymous memory at the end (RSS less the pages\n"
          " of memory-mapped files, which the kernel can drop and read again); cache MB: the most the expert cache held; hits, misses and MB\n"
          " read per decode token: a full run's counts minus its 1-token run's (the prefill), over the new tokens (in\n"
          " place: the bytes of the experts faulted in again);\n"
          " vs mem: decode tok/s over the median of the in-memory eager rows of the same storage; hit rate: the\n"
          " cache's hits over lookups in decode (a read ahead the decode later asks for is a hit); predictor: of the\n"
          " experts each layer's router chose in decode, the share the previous layer's prediction named (prefetch);\n"
          " same tokens: equal to the in-memory row's greedy tokens of the same storage and step (eager or compiled); llama.cpp's peak RSS counts\n"
          " the pages of its memory-mapped file that it touched)")
    if why_not is not None:
        print(f"llama.cpp: not measured ({why_not})")
    if args.storage != "both":
        return  # the claim's speed part compares int4 with bf16 experts: no verdict without both
    verdict = judged(rows)
    print(f"\nverdict: {verdict['verdict']}; " + "; ".join(f"{k}: {j['verdict']} ({j['reason']})"
                                                         for k, j in verdict["judgements"].items()))
    if not args.smoke and not args.no_record and not args.eager_only:
        from zoo.evaluation.claims import record

        command = "python benchmarks/offload.py" + (f" --repeats {args.repeats}" if args.repeats != 2 else "")
        record("offload", CLAIM, verdict["verdict"], verdict["summary"], verdict["numbers"], command,
               f"Mixtral-shaped 304M (4 layers x 8 experts, top-2), {args.new_tokens} greedy tokens, "
               f"{args.threads} threads", judgements=verdict["judgements"])


CLAIM = ("FloE: with experts kept compressed outside memory and fetched on demand for the routed ones, a model "
         "decodes within a memory budget well below its size, and compression makes the fetches cheaper")


def judged(rows: list[dict]) -> dict:
    """The claim's two parts under the one rule, from the zoo rows' repeats (llama.cpp is shown, not judged)."""
    from zoo.evaluation.claims import combine, judge

    def values(storage, label_start, key):
        return [key(r) for r in rows if r["storage"] == storage and r["label"].split(" (")[0] == label_start]

    above = lambda r: r["peak_mb"] - r["start_mb"]  # noqa: E731
    memory = judge(values("bf16", "offload, cache 25%", above), values("bf16", "in memory", above))
    speed = judge(values("int4", "offload, cache 25%", lambda r: r["decode"]),
                  values("bf16", "offload, cache 25%", lambda r: r["decode"]), lower_is_better=False)
    same = all(r["same"] for r in rows if r["engine"] == "offload")  # the judged rows: the cache's
    judgements = {"memory: bf16 offload (25% cache) vs in memory, MB above the imports": memory,
                  "speed: int4 vs bf16 experts, offloaded (25% cache), decode tok/s": speed}
    verdict = combine([memory["verdict"], speed["verdict"]]) if same else "does not hold"
    numbers = [{"experts": r["storage"], "engine": r["label"], "repeat": r.get("repeat", 0),
                "tok_s": round(r["decode"], 1), "peak_minus_start_mb": round(r["peak_mb"] - r["start_mb"]),
                "misses_per_token": round(r["cache"]["misses"], 2) if r.get("cache") else "-",
                "mb_read_per_token": round(r["cache"]["bytes_read"] / 1e6, 1) if r.get("cache") else "-"}
               for r in rows]
    summary = (f"offloaded with a 25% cache, {memory['mechanism']:.0f} MB above the imports instead of "
               f"{memory['control']:.0f} in memory (bf16; noise {memory['noise']:.0f} MB over {memory['repeats']} "
               f"fresh processes each): {memory['verdict']}; int4 experts decode at {speed['mechanism']:.1f} tok/s "
               f"against {speed['control']:.1f} for bf16 experts, both offloaded (noise {speed['noise']:.1f}): "
               f"{speed['verdict']}; greedy tokens {'identical to' if same else 'DIFFERENT from'} the in-memory "
               "model's. FloE's activation sparsity and channel predictors are not built here; its prefetch "
               "(prefetch=True) is shown, not judged.")
    return {"verdict": verdict, "summary": summary, "numbers": numbers, "judgements": judgements}


if __name__ == "__main__":
    main()
