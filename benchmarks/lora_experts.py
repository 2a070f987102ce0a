"""Benchmark: lora-experts' grouped LoRA against PEFT's own ``target_parameters`` path, same model, same run.

Both variants put the same LoRA (same seed, rank, alpha) on every expert's ``gate_up_proj`` and ``down_proj`` of
zoo-tiny-moe (fp32 weights, bf16 autocast, as ``moe-zoo finetune`` trains):

- ``grouped``: lora-experts. Each expert adds ``scale * (x A_e^T) B_e^T`` on its own token slice.
- ``peft``: the same LoraConfig without the zoo's wrapper. PEFT 0.21 folds the update into the weight at every
  forward (``W + scale * B A``, one E x out x in tensor per targeted parameter, kept for backward) and the backward
  builds that tensor's gradient too.

Each variant runs in its own subprocess (``--worker``): load, attach, then a few training steps on fixed
windows. Memory (torch's CPU allocations are invisible to tracemalloc), two ways:
- tensor peak: one more training step under ``torch.profiler`` with ``profile_memory``; the highest "Total
  Allocated" of its ``[memory]`` events is the peak of tensor bytes allocated during the step;
- RSS: the growth of the process's peak RSS (``ru_maxrss``) during all steps over its peak after setup; it also
  counts what the allocator and oneDNN keep (kernels JIT-compiled per new matmul shape, scratch space).
Step time is the median over the timed steps; prefill is one no-grad forward over the batch. The first step's
losses must agree. A last pair of columns isolates one MoE layer (layer 0's experts on their real inputs):
forward + backward to the LoRA factors, where PEFT's fold is not diluted by attention, embeddings and logits.

    python benchmarks/lora_experts.py                  # batches 8 x 256 and 1 x 256, 6 timed steps, 1 thread
    python benchmarks/lora_experts.py --smoke          # tiny: 2 x 32, 1 step
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("grouped", "peft")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def step_tensor_peak_mb(step) -> float:
    """Peak of tensor bytes allocated while ``step()`` runs, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0) / 2**20


def worker(variant: str, model: str, batch: int, seq_len: int, steps: int, warmup: int, rank: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    import zoo
    from zoo.data.tokenizer import load_tokenizer
    from zoo.data.tokens import eval_windows, token_stream
    from zoo.moe.layout import moe_layers
    from zoo.training.precision import training_autocast

    torch.set_num_threads(1)
    base = zoo.load(model, dtype=torch.float32)
    windows = eval_windows(token_stream("code", "val", load_tokenizer()), seq_len)  # a small split: low setup peak
    names = [f"model.layers.{i}.mlp.experts.{t}" for i, _ in moe_layers(base) for t in ("gate_up_proj", "down_proj")]
    torch.manual_seed(0)
    if variant == "grouped":
        peft_model = zoo.apply(base, "lora-experts", r=rank, alpha=2 * rank)
    else:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=names,
                            task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, config)  # PEFT's own ParamWrapper
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero; a non-zero update makes both paths do real work
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01, generator=g)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    batches = [windows[(i * batch) % (len(windows) - batch):][:batch] for i in range(warmup + steps)]
    setup_peak = peak_rss_mb()
    times, losses = [], []

    def step(ids):
        with training_autocast():
            loss = peft_model(input_ids=ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    peft_model.train()
    for i, ids in enumerate(batches):
        t = time.perf_counter()
        step(ids)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    train_peak = peak_rss_mb()
    tensor_peak = step_tensor_peak_mb(lambda: step(batches[warmup]))
    peft_model.eval()
    with torch.no_grad(), training_autocast():
        peft_model(input_ids=batches[0])
        t = time.perf_counter()
        peft_model(input_ids=batches[0])
        prefill = time.perf_counter() - t

    # One MoE layer alone (layer 0's experts, its real inputs and routing): forward + backward to the LoRA factors.
    moe = moe_layers(peft_model.get_base_model())[0][1]
    seen = []
    handle = moe.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        peft_model(input_ids=batches[0])
    handle.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])
    with torch.no_grad():
        routing = moe.router(x)

    def layer_step():
        with training_autocast():
            out = moe.experts(x, routing)
        out.float().square().mean().backward()
        optimizer.zero_grad(set_to_none=True)

    layer_step()
    layer_times = []
    for _ in range(5):
        t = time.perf_counter()
        layer_step()
        layer_times.append(time.perf_counter() - t)
    return {"variant": variant, "tensor_peak_mb": tensor_peak, "setup_peak_mb": setup_peak,
            "extra_peak_mb": train_peak - setup_peak, "step_ms": 1000 * statistics.median(times),
            "prefill_ms": 1000 * prefill, "first_loss": losses[0], "lora_params": sum(p.numel() for p in params),
            "layer_peak_mb": step_tensor_peak_mb(layer_step), "layer_ms": 1000 * statistics.median(layer_times)}


def measure(args, size: str) -> dict:
    """Both variants at one size; timings are the best of ``--repeats`` runs taken in alternating order."""
    runs = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            cmd = [sys.executable, __file__, "--worker", variant, "--model", args.model, "--sizes", size,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--rank", str(args.rank)]
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(run.stdout.strip().splitlines()[-1]))
    rows = {}
    for variant, results in runs.items():
        rows[variant] = {**results[0], **{k: min(r[k] for r in results) for k in ("step_ms", "prefill_ms", "layer_ms")}}
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--sizes", nargs="+", default=["8x256", "1x256"], help="batch x sequence length")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant (timings: the best)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step, one run")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.steps, args.warmup, args.repeats = ["2x32"], 1, 1, 1
    if args.worker:
        batch, seq_len = map(int, args.sizes[0].split("x"))
        print(json.dumps(worker(args.worker, args.model, batch, seq_len, args.steps, args.warmup, args.rank)))
        return
    from zoo.training.precision import precision_label

    print(f"{args.model}: LoRA r={args.rank}, alpha={2 * args.rank} on gate_up_proj + down_proj of every expert; "
          f"fp32 weights, {precision_label()}, 1 thread; {args.steps} timed steps after {args.warmup}, "
          f"best of {args.repeats} runs")
    print(f"{'':17}{'--------------- training step (whole model) ---------------':>62}"
          f"{'-- one MoE layer, fwd+bwd --':>30}")
    print(f"{'size':8}{'variant':9}{'tensor peak MB':>16}{'RSS growth MB':>15}{'step ms':>10}{'prefill ms':>12}"
          f"{'loss@1':>9}{'tensor peak MB':>18}{'ms':>12}")
    summary = []
    for size in args.sizes:
        rows = measure(args, size)
        for variant, r in rows.items():
            print(f"{size:8}{variant:9}{r['tensor_peak_mb']:16.1f}{r['extra_peak_mb']:15.0f}{r['step_ms']:10.0f}"
                  f"{r['prefill_ms']:12.0f}{r['first_loss']:9.4f}{r['layer_peak_mb']:18.1f}{r['layer_ms']:12.1f}")
        summary.append((size, rows["grouped"], rows["peft"]))
    for size, g, p in summary:
        def ratio(key, g=g, p=p):
            return g[key] / p[key] if p[key] > 0 else float("nan")

        agree = abs(g["first_loss"] - p["first_loss"]) <= 2e-2 * abs(p["first_loss"])
        print(f"{size}: grouped / peft: model step tensor peak {ratio('tensor_peak_mb'):.2f}, RSS growth "
              f"{ratio('extra_peak_mb'):.2f}, step time {ratio('step_ms'):.2f}, prefill {ratio('prefill_ms'):.2f}; "
              f"one layer: tensor peak {ratio('layer_peak_mb'):.2f}, time {ratio('layer_ms'):.2f}; "
              f"first losses agree: {agree}")


if __name__ == "__main__":
    main()
