"""Benchmark: models bigger than memory. Peak RSS and wall time of convert, apply and eval, streamed layer by
layer from the shards against the in-memory path, on random bf16 Mixtral-shaped checkpoints it writes itself.

Each operation runs as its own child process (the ``moe-zoo`` command line) so its peak RSS (VmHWM) is its
own; the parent samples the child's RSS over time for the plot.

    python benchmarks/scale.py                    # 3.7 GB checkpoint, both paths; then the ~30 GB one, streamed
    python benchmarks/scale.py --skip-big         # only the 3.7 GB comparison
    python benchmarks/scale.py --smoke            # tiny shapes, a few seconds (the test suite runs this)

Shapes: hidden 2048, intermediate 5632, 8 experts top-2, vocab 16384 (the zoo's tokenizer of 8192 ids
fits a vocabulary at most twice its size; the tables in docs/scale.md were recorded with 32000, before that check).
3.6 GB with 6 layers; 48 layers ~29 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_checkpoint(path, layers, hidden=2048, intermediate=5632, experts=8, vocab=16384, heads=16, kv_heads=8,
                    seed=0, shard_bytes=2 << 30):
    """A native Mixtral checkpoint of random bf16 weights, written a layer at a time under transformers' own
    key names (per-expert w1/w2/w3, as ``save_pretrained`` writes them)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from tqdm.auto import tqdm

    from zoo.io.shards import ShardWriter

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=4096,
                        tie_word_embeddings=False, dtype="bfloat16")
    cfg.architectures = ["MixtralForCausalLM"]
    with torch.device("meta"):
        meta = MixtralForCausalLM(cfg)
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    writer = ShardWriter(tmp, shard_bytes)
    writer.add({"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                "lm_head.weight": rand(vocab, hidden)})
    head_dim = hidden // heads
    for i in tqdm(range(layers), desc="writing the random checkpoint"):
        p = f"model.layers.{i}."
        sd = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
              p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
              p + "mlp.gate.weight": rand(experts, hidden, std=0.5),
              p + "mlp.experts.gate_up_proj": rand(experts, 2 * intermediate, hidden),
              p + "mlp.experts.down_proj": rand(experts, hidden, intermediate)}
        writer.add(revert_weight_conversion(meta, sd))
    writer.close()
    cfg.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the zoo's tokenizer (8192 ids, at least half the vocabulary)
        shutil.copy(os.path.join(ROOT, "zoo", "_data", "tokenizer", name), tmp)
    os.rename(tmp, path)
    return path


def folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def measured(args, label, interval=0.25) -> dict:
    """Run ``moe-zoo ARGS`` in a child; its peak RSS (VmHWM, written by the child at exit), wall time and an
    RSS-over-time trace sampled here."""
    hwm = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"scale-hwm-{os.getpid()}-{label}.txt")
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: open({hwm!r}, 'w').write(next(l for l in open('/proc/self/status') "
            "if l.startswith('VmHWM')).split()[1]))\n"
            "from zoo.cli import main\n"
            f"sys.argv = ['moe-zoo'] + {list(args)!r}\n"
            "main()\n")
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    errors = open(hwm + ".err", "w+")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=errors, env=env, text=True)
    trace = []
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
            trace.append((round(time.perf_counter() - start, 2), rss * 1024))
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            pass
        time.sleep(interval)
    out = proc.stdout.read()
    wall = time.perf_counter() - start
    errors.seek(0)
    log = errors.read()
    errors.close()
    os.remove(hwm + ".err")
    if proc.returncode != 0:
        raise RuntimeError(f"moe-zoo {' '.join(args)} failed:\n{(out + log)[-3000:]}")
    with open(hwm) as f:
        peak = int(f.read()) * 1024
    os.remove(hwm)
    return {"label": label, "args": list(args), "wall_s": round(wall, 1), "peak_rss": peak, "trace": trace,
            "output": out}


def eval_json(output: str) -> dict:
    """The JSON object ``moe-zoo eval --json`` printed (its standard output holds nothing else)."""
    return json.loads(output)


def same_tensors(a, b) -> bool:
    """Whether two checkpoint folders hold the same tensors (read one tensor at a time)."""
    from zoo.io.checkpoint import weight_map, read_tensors

    ma, mb = weight_map(a), weight_map(b)
    if set(ma) != set(mb):
        return False
    for key in ma:
        x, y = read_tensors({ma[key]: [key]})[key], read_tensors({mb[key]: [key]})[key]
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def compare(src, work, windows, calibration_tokens, only=None, modes=("--no-stream", "--stream"), keep=None) -> list[dict]:
    """Each operation (or those whose name starts with one of ``only``) both ways on ``src``."""
    size = folder_bytes(src)
    cal = ["--calibration", f"mixed:{calibration_tokens}"]
    ops = [("convert", ["convert", src, "{out}"]),
           ("apply prune-reap:num_experts=6", ["apply", src, "prune-reap:num_experts=6", "--out", "{out}", *cal]),
           ("apply quantize:bits=4", ["apply", src, "quantize:bits=4", "--out", "{out}"]),
           ("eval", ["eval", src, "--windows", str(windows), "--no-speed", "--json"])]
    rows = []
    for name, template in ops:
        if only and not any(name.startswith(o) for o in only):
            continue
        row = dict((keep or {}).get(name, {}), operation=name, checkpoint_bytes=size)
        outs = {}
        for mode in modes:
            out = os.path.join(work, f"{name.split()[0]}-{name.split(':')[0].split()[-1]}{mode}")
            shutil.rmtree(out, ignore_errors=True)
            args = [a.replace("{out}", out) for a in template] + [mode]
            m = measured(args, f"{name}{mode}".replace(" ", "_").replace(":", "_").replace("=", "_"))
            row["memory" if mode == "--no-stream" else "stream"] = m
            outs[mode] = out
            print(f"  {name:34} {mode:12} peak {m['peak_rss'] / 1e9:6.2f} GB ({m['peak_rss'] / size:.2f}x)  "
                  f"wall {m['wall_s']:7.1f} s", flush=True)
        if len(modes) < 2:  # the other mode's measurement is kept from an earlier run
            row["same"] = None
        elif name == "eval":
            a, b = (eval_json(row[k]["output"])["perplexity"] for k in ("memory", "stream"))
            row["same"] = all(abs(a[d] - b[d]) <= 1e-4 * abs(a[d]) for d in a)
            row["perplexity"] = {"memory": a, "stream": b}
        else:
            row["same"] = same_tensors(outs["--no-stream"], outs["--stream"])
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
    return rows


def big_run(src, work, windows, calibration_tokens) -> dict:
    out = os.path.join(work, "big-pruned-int4")
    shutil.rmtree(out, ignore_errors=True)
    layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    apply = measured(["apply", src, "prune-reap:num_experts=6", "quantize:bits=4", "--out", out, "--stream",
                      "--calibration", f"mixed:{calibration_tokens}"], "big_apply")
    ev = measured(["eval", out, "--windows", str(windows), "--no-speed", "--json", "--stream"], "big_eval")
    result = {"checkpoint_bytes": folder_bytes(src), "layers": layers, "apply": apply, "eval": ev,
              "output_bytes": folder_bytes(out),
              "perplexity": eval_json(ev["output"])["perplexity"]}
    shutil.rmtree(out, ignore_errors=True)
    return result


def plot(rows, big, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("3.7 GB checkpoint: in memory", [(r["operation"], r["memory"]) for r in rows if "memory" in r]),
              ("3.7 GB checkpoint: streamed", [(r["operation"], r["stream"]) for r in rows if "stream" in r])] if rows else []
    if big:
        panels.append((f"{big['checkpoint_bytes'] / 1e9:.0f} GB checkpoint: streamed",
                       [("apply prune-reap + quantize int4", big["apply"]), ("eval", big["eval"])]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    size = rows[0]["checkpoint_bytes"] if rows else None
    for ax, (title, runs) in zip(axes[0], panels):
        for name, m in runs:
            t = [p[0] for p in m["trace"]]
            ax.plot(t, [p[1] / 1e9 for p in m["trace"]], label=name)
        if size:
            ax.axhline(size / 1e9, color="grey", ls="--", lw=0.8, label="3.7 GB checkpoint size")
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (GB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(rows, big) -> str:
    lines = ["| operation | in memory: peak RSS (x ckpt) | streamed: peak RSS (x ckpt) | in memory: wall s | "
             "streamed: wall s | streamed / in memory (wall) | same result |", "|---|---|---|---|---|---|---|"]
    def rss(m, size):
        return f"{m['peak_rss'] / 1e9:.2f} GB ({m['peak_rss'] / size:.2f}x)" if m else "-"

    for r in rows:
        m, s, size = r.get("memory"), r.get("stream"), r["checkpoint_bytes"]
        ratio = f"{s['wall_s'] / m['wall_s']:.2f}" if m and s else "-"
        same = {True: "yes", False: "NO", None: "-"}[r.get("same")]
        lines.append(f"| {r['operation']} | {rss(m, size)} | {rss(s, size)} | {m['wall_s'] if m else '-'} | "
                     f"{s['wall_s'] if s else '-'} | {ratio} | {same} |")
    if big:
        for key, name in (("apply", "apply prune-reap:num_experts=6 quantize:bits=4"), ("eval", "eval")):
            m = big[key]
            lines.append(f"| {big['checkpoint_bytes'] / 1e9:.1f} GB, {big['layers']} layers: {name} | (does not fit) | "
                         f"{m['peak_rss'] / 1e9:.2f} GB ({m['peak_rss'] / big['checkpoint_bytes']:.3f}x) | | "
                         f"{m['wall_s']:.0f} ({m['wall_s'] / big['layers']:.1f} s/layer) | | |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/scale", help="Where the checkpoints and outputs go (needs ~45 GB).")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--big-layers", type=int, default=48)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--modes", nargs="+", default=["no-stream", "stream"], choices=["no-stream", "stream"],
                    help="Which paths to measure (a row keeps the other path's measurement from --json).")
    ap.add_argument("--ops", nargs="*", help="Only these operations (convert, apply prune, apply quantize, eval); "
                                              "the others' rows are kept from --json.")
    ap.add_argument("--only-big", action="store_true", help="Run the big checkpoint only; the 3.7 GB rows are read "
                                                             "back from --json.")
    ap.add_argument("--windows", type=int, default=8, help="Held-out windows per domain for eval.")
    ap.add_argument("--calibration-tokens", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="Tiny shapes: checks the harness, measures nothing useful.")
    ap.add_argument("--json", default="docs/scale.json", help="Where the measurements go (with the RSS traces).")
    ap.add_argument("--plot", default="docs/scale-rss.png")
    args = ap.parse_args(argv)
    shape = dict(hidden=2048, intermediate=5632, vocab=16384)
    if args.smoke:
        shape = dict(hidden=64, intermediate=128, vocab=8192, heads=4, kv_heads=2)
        args.layers, args.skip_big, args.windows, args.calibration_tokens = 2, True, 2, 512
    os.makedirs(args.work, exist_ok=True)
    print(f"torch threads: {torch.get_num_threads()}")
    if args.only_big:
        rows = json.load(open(args.json))["rows"] if os.path.exists(args.json) else []
    else:
        base = make_checkpoint(os.path.join(args.work, f"mixtral-{args.layers}L"), args.layers, **shape)
        print(f"checkpoint {base}: {folder_bytes(base) / 1e9:.2f} GB")
        earlier = {r["operation"]: r for r in json.load(open(args.json))["rows"]} if os.path.exists(args.json) else {}
        rows = compare(base, args.work, args.windows, args.calibration_tokens, args.ops,
                       tuple(f"--{m}" for m in args.modes), earlier)
        if args.ops and os.path.exists(args.json):  # the other operations' rows are kept from the last run
            new = {r["operation"]: r for r in rows}
            rows = [new.pop(r["operation"], r) for r in json.load(open(args.json))["rows"]] + list(new.values())
    big = None
    if not args.skip_big:
        src = make_checkpoint(os.path.join(args.work, f"mixtral-{args.big_layers}L"), args.big_layers, **shape)
        print(f"checkpoint {src}: {folder_bytes(src) / 1e9:.2f} GB (this machine: "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1e9:.1f} GB of memory)")
        big = big_run(src, args.work, args.windows, args.calibration_tokens)
    print(table(rows, big))
    if big:
        print(f"big model perplexity after prune + int4 (random weights): {big['perplexity']}; "
              f"output {big['output_bytes'] / 1e9:.2f} GB")
    if not args.smoke:
        if big is None and os.path.exists(args.json):
            big = json.load(open(args.json)).get("big")
        for path in (args.json, args.plot):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "big": big}, f)
        plot(rows, big, args.plot)
        print(f"wrote {args.json} and {args.plot}")
    return rows, big


if __name__ == "__main__":
    main()
