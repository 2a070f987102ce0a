"""Benchmark: how long a streamed ``apply`` takes per layer, phase by phase, and what that predicts for real MoE
checkpoints on this machine, on one GPU and on eight (docs/scale.md's time model).

Measured here (``zoo.editing.phases``): a streamed ``prune-reap`` + 4-bit ``quantize`` of a random Mixtral-shaped
checkpoint it writes itself, the seconds per layer spent reading the layer's tensors, calibrating (carrying the
calibration tokens through attention and the MoE block, and gathering the statistics of the statistics pass),
compressing (REAP's saliencies, the expert selection, quantization) and writing. From them, rates:

- read and write: bytes per second;
- calibrate: seconds per (token x active parameter of the layer) (a forward is ~2 FLOPs per token and parameter);
- compress: seconds per (token x active parameter) for the statistics plus seconds per stored parameter for the
  weight work (two unknowns: fitted from two calibration sizes).

A model's layer time is then read(bytes) + calibrate(tokens, active) + compress(tokens, active, params) +
write(bytes out). The GPU columns replace the compute rates by a stated throughput (``--gpu-tflops``, effective, for
the statistics and forwards; ``--gpu-params-per-s`` for the weight work), keep the disk rates (the layer is read from
the same disk and onloaded), and split the calibration work by the number of GPUs (``zoo.editing.distributed``:
each rank carries its share of the tokens; every rank reads the layer, from the page cache after the first).

    python benchmarks/time_model.py                 # 4 layers of hidden 2048 (2.3 GB), 1024 and 2048 tokens
    python benchmarks/time_model.py --smoke         # tiny shapes: checks the harness
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scale import folder_bytes, make_checkpoint  # noqa: E402

# (layers, hidden, expert intermediate, experts, top-k, shared expert intermediate, attention params per layer)
MODELS = {
    "OLMoE-1B-7B": dict(layers=16, hidden=2048, inter=1024, experts=64, top_k=8, shared=0, attn=4 * 2048 * 2048),
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, inter=768, experts=128, top_k=8, shared=0,
                          attn=2048 * 4096 * 2 + 2048 * 512 * 2),
    "Mixtral-8x7B": dict(layers=32, hidden=4096, inter=14336, experts=8, top_k=2, shared=0,
                         attn=4096 * 4096 * 2 + 4096 * 1024 * 2),
    "DeepSeek-V3": dict(layers=61, hidden=7168, inter=2048, experts=256, top_k=8, shared=2048,
                        attn=187_000_000),  # MLA projections, ~0.19 B per layer
}


def layer_sizes(m: dict, bytes_per_param: float = 2.0) -> dict:
    """Stored and active parameters of one MoE layer, and its bytes in bf16."""
    expert = 3 * m["hidden"] * m["inter"]
    shared = 3 * m["hidden"] * m["shared"]
    stored = m["attn"] + m["experts"] * expert + shared + m["experts"] * m["hidden"]
    active = m["attn"] + m["top_k"] * expert + shared
    return {"stored": stored, "active": active, "bytes": stored * bytes_per_param}


def measure(src: str, out: str, tokens: int, recipe) -> dict:
    from zoo.editing import phases, stream
    from zoo.editing.calibration import corpus

    shutil.rmtree(out, ignore_errors=True)
    phases.reset()
    start = time.perf_counter()
    stream.apply(src, recipe, out, calibration=corpus("mixed", tokens=tokens))
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, **{k: v for k, v in phases.SECONDS.items()},
            "bytes_out": folder_bytes(out)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--work", default=None, help="where the checkpoint goes (default: a temporary folder)")
    ap.add_argument("--tokens", type=int, nargs=2, default=[1024, 2048])
    ap.add_argument("--calibration-tokens", type=int, default=8192, help="tokens the predictions assume")
    ap.add_argument("--gpu-tflops", type=float, default=300.0,
                    help="effective bf16 throughput of one GPU for the forwards and statistics (H100/H200 class: "
                         "~990 dense peak; 30%% of it)")
    ap.add_argument("--gpu-params-per-s", type=float, default=2e10, help="weight work (selection, quantization) "
                                                                          "on one GPU, parameters per second")
    ap.add_argument("--json", default="docs/time_model.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    shape = (dict(layers=2, hidden=64, intermediate=128, vocab=8192, heads=4, kv_heads=2) if args.smoke else
             dict(layers=4, hidden=2048, intermediate=5632, vocab=8192, heads=16, kv_heads=8))
    if args.smoke:
        args.tokens = [256, 512]
    root = args.work or tempfile.mkdtemp(prefix="time-model-")
    try:
        src = make_checkpoint(os.path.join(root, f"mixtral-{shape['layers']}L-{shape['hidden']}"), **shape)
        recipe = [("prune-reap", {"num_experts": 6}), ("quantize", {"bits": 4})]
        runs = [measure(src, os.path.join(root, "out"), t, recipe) for t in args.tokens]
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)
    n = shape["layers"]
    here = dict(layers=n, hidden=shape["hidden"], inter=shape["intermediate"], experts=8, top_k=2, shared=0,
                attn=2 * shape["hidden"] ** 2 + 2 * shape["hidden"] * shape["hidden"] // 2)
    size = layer_sizes(here)
    print(f"measured: {n} layers of {size['bytes'] / 1e9:.2f} GB (bf16), recipe prune-reap:num_experts=6 quantize:bits=4")
    print(f"{'tokens':>7} {'wall s':>7} " + " ".join(f"{p + ' s/layer':>22}" for p in
                                                     ("read", "calibrate", "statistics pass", "compress", "write")))
    for r in runs:
        print(f"{r['tokens']:7d} {r['wall_s']:7.1f} " + " ".join(f"{r.get(p, 0.0) / n:22.2f}" for p in
                                                              ("read", "calibrate", "statistics pass", "compress",
                                                               "write")))
    (a, b) = runs
    read_bw = size["bytes"] * n / max(1e-9, (a.get("read", 0) + b.get("read", 0)) / 2)
    write_bw = a["bytes_out"] / max(1e-9, (a.get("write", 0) + b.get("write", 0)) / 2)
    work = lambda r: r.get("calibrate", 0) + r.get("statistics pass", 0)  # noqa: E731
    cal_rate = (work(b) - work(a)) / (n * (b["tokens"] - a["tokens"]) * size["active"])
    comp_tok = max(0.0, (b.get("compress", 0) - a.get("compress", 0)) / (n * (b["tokens"] - a["tokens"]) * size["active"]))
    comp_param = max(0.0, (a.get("compress", 0) / n - comp_tok * a["tokens"] * size["active"]) / size["stored"])
    rates = {"read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw, "calibrate_s_per_token_param": cal_rate,
             "compress_s_per_token_param": comp_tok, "compress_s_per_param": comp_param}
    print("rates: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()))
    T = args.calibration_tokens
    gpu_tok_param = 2 / (args.gpu_tflops * 1e12)  # seconds per token x parameter of a forward on the GPU

    def layer_time(m, gpus=0):
        s = layer_sizes(m)
        out_bytes = s["bytes"] * (a["bytes_out"] / (size["bytes"] * n))  # the recipe's compression ratio here
        read, write = s["bytes"] / read_bw, out_bytes / write_bw
        if gpus == 0:
            compute = T * s["active"] * (cal_rate + comp_tok) + s["stored"] * comp_param
        else:  # the statistics pass and the carry on the GPU, split over the GPUs' share of the tokens
            compute = T * s["active"] * gpu_tok_param * 2 / gpus + s["stored"] / args.gpu_params_per_s
        return read + compute + write

    rows = []
    print(f"\npredicted wall time of apply prune-reap + quantize:bits=4 with {T} calibration tokens "
          f"(streamed, one layer at a time)")
    print(f"{'model':16} {'layers':>6} {'GB/layer':>9} {'this machine':>14} {'1 GPU':>10} {'8 GPUs':>10}")
    for name, m in MODELS.items():
        cells = [layer_time(m, g) * m["layers"] for g in (0, 1, 8)]
        rows.append({"model": name, "layers": m["layers"], "layer_gb": layer_sizes(m)["bytes"] / 1e9,
                     "this_machine_s": cells[0], "one_gpu_s": cells[1], "eight_gpus_s": cells[2]})
        print(f"{name:16} {m['layers']:6d} {layer_sizes(m)['bytes'] / 1e9:9.2f} " +
              " ".join(f"{c / 3600:9.2f} h" if c > 3600 else f"{c / 60:8.1f} min" for c in cells))
    if not args.smoke:
        with open(args.json, "w") as f:
            json.dump({"measured": runs, "rates": rates, "assumptions": {
                "calibration_tokens": T, "gpu_tflops": args.gpu_tflops, "gpu_params_per_s": args.gpu_params_per_s},
                "predictions": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
