"""CPU decode and prefill speed, one table, one run: transformers' own Mixtral (eager and grouped_mm
experts, dynamic cache) against the zoo model eager and with the compiled static-cache decode step, in
bf16 and with int8 / int4 experts; llama.cpp rows where ``llama_cpp`` and a GGUF of the same weights exist.

    python benchmarks/decode.py                     # the Mixtral-shaped 304M model and zoo-tiny-moe
    python benchmarks/decode.py --profile           # also: where one compiled decode step spends its time
    python benchmarks/decode.py --smoke             # tiny sizes, seconds (the test suite runs this)

Decode tok/s = (new tokens - 1) / (time of the full run - time of a 1-token run), greedy, batch 1.
Prefill tok/s = prompt tokens / time of one eager forward over a 256-token prompt.
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # compile times are cold, not cached

import argparse
import contextlib
import copy
import statistics
import time

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import zoo
from zoo.moe import kernels
from zoo.runtime.decode import greedy, timed_generate, timed_greedy


def mixtral_shaped(smoke: bool, layers: int = 4) -> MixtralForCausalLM:
    """The random model of issue #6 (hidden 1024, intermediate 2816, 8 experts top-2, 4 layers, 16/4 heads,
    vocab 8192, 304M parameters), seeded; a miniature of it with --smoke; ``layers``: deeper, the same layers."""
    size = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=8192) if smoke else dict(hidden_size=1024, intermediate_size=2816,
                                                    num_attention_heads=16, num_key_value_heads=4, vocab_size=8192)
    cfg = MixtralConfig(**size, num_hidden_layers=layers, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)  # spread the routing over the experts
    return model.to(torch.bfloat16)


def native(model, impl: str):
    m = copy.deepcopy(model)
    m.config._experts_implementation = impl  # MixtralExperts dispatches on it at each call
    for layer in m.model.layers:
        layer.mlp.experts.config = m.config
    return m


@torch.no_grad()
def prefill_tok_s(model, tokens: int, vocab: int, repeats: int = 3) -> float:
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(input_ids=ids)
        times.append(time.perf_counter() - t)
    return tokens / statistics.median(times)


def same_weights(base, all_matrices: bool = True) -> dict:
    """The zoo model in bf16 and quantized: experts only (int8, int4) and, with ``all_matrices``, every matrix but
    the embeddings and routers (``targets="all"``: int8 all, int4 all), each a copy made before anything compiles."""
    out = {"bf16": base}
    for targets in ("experts", "all") if all_matrices else ("experts",):
        for bits in (8, 4):
            key = f"int{bits}" + (" all" if targets == "all" else "")
            out[key] = zoo.apply(copy.deepcopy(base), "quantize", bits=bits, targets=targets)
    return out


def engines(model, without_kernel: bool = True):
    """(label, model, compile, kernel) for every engine, from one native model: the weights are the same in all.
    kernel: whether the compiled step may use zoo::moe_gemv (the "torch kernels" rows, with ``without_kernel``,
    are the same step without it; the full run, which also has the all-matrices rows)."""
    base = zoo.convert(copy.deepcopy(model)).eval()
    # every copy is made before anything compiles (a deepcopy would carry transformers' cached compiled call)
    quantized = same_weights(base, all_matrices=without_kernel)
    if not without_kernel:  # the smoke run: int4 stands for the compiled rows (one compile; the bf16 and int8 steps
        quantized.pop("int8")  # are tested in test_decode)
        quantized.pop("bf16")
    torch_rows = {key: copy.deepcopy(m) for key, m in quantized.items() if key in ("bf16", "int8", "int4")}
    rows = [("transformers eager", native(model, "eager"), False, False),
            ("transformers grouped_mm", native(model, "grouped_mm"), False, False),
            ("zoo bf16 eager", base, False, False),
            *((f"zoo {key} compiled", m, True, True) for key, m in quantized.items())]
    if without_kernel and kernels.load():
        rows += [(f"zoo {label} torch kernels", m, True, False) for label, m in torch_rows.items()]
    return rows


def bytes_per_token(model) -> int:
    """Bytes of weights one decode token reads at batch 1: every parameter and buffer but the embedding table (one
    row a token; all of it when tied to the LM head, which reads it whole), and of each layer's routed experts the
    top-k share (k of E experts a token)."""
    cfg = model.config
    k = getattr(cfg, "num_experts_per_tok", None)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    share = k / experts if k and experts else 1.0
    embed = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is embed  # (a packed head has no .weight)
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is embed and not tied:
            continue
        total += t.numel() * t.element_size() * (share if ".experts." in name else 1.0)
    return int(total)


@torch.no_grad()
def run_model(name: str, model, new_tokens: int, prompt: int, prefill: int, loop: bool = True) -> list:
    """Every engine's row; ``loop=False`` skips the zoo-loop column and the rows without the zoo's kernel (more
    compilations; the smoke run)."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    rows, reference = [], None
    for label, m, compiled, kernel in engines(model, without_kernel=loop):
        torch._dynamo.reset()
        with contextlib.nullcontext() if kernel else kernels.turned_off():
            r = timed_generate(m, ids, new_tokens, compile=compiled)
            lean = timed_greedy(m, ids, new_tokens, compile=True)["decode_tok_s"] if compiled and loop else None
            jit = timed_greedy(m, ids, new_tokens, compile=True, ahead_of_time=False)["decode_tok_s"] \
                if compiled and loop else None
        reference = r["tokens"] if reference is None else reference
        rows.append({"model": name, "engine": label, "decode": r["decode_tok_s"], "loop": lean, "jit": jit,
                     "prefill": prefill_tok_s(m, prefill, vocab), "compile_s": r["warmup_s"] if compiled else None,
                     "first_ms": r["first_token_s"] * 1e3, "same": bool(torch.equal(r["tokens"], reference)),
                     "bytes": bytes_per_token(m)})
        print(f"  {name}: {label} done ({r['decode_tok_s']:.0f} tok/s)", flush=True)
    return rows


@torch.no_grad()
def fp32_tokens_equal(model, prompt: int, new_tokens: int) -> dict:
    """In fp32, the compiled step (zoo::moe_gemv) against the eager reference: equal greedy tokens, per precision."""
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    out = {}
    for label, m in same_weights(zoo.convert(copy.deepcopy(model)).float().eval()).items():
        label = "fp32" if label == "bf16" else label
        torch._dynamo.reset()
        out[label] = bool(torch.equal(greedy(m, ids, new_tokens, compile=False), greedy(m, ids, new_tokens)))
    return out


def profile_step(model, steps: int = 16) -> str:
    """Where the compiled decode step spends its time (CPU profiler over the lean loop's steps)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    greedy(model, ids, steps + 1, ahead_of_time=False)  # compile first (same cache length as the profiled run)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        greedy(model, ids, steps + 1, ahead_of_time=False)  # the JIT step: the profiler sees its kernels
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and no zoo-loop column, for the test suite")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-shipped", action="store_true")
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp rows: the same weights as GGUF files "
                    "the zoo writes, bf16 and the zoo's int8 / int4 codes as Q8_0 / Q4_1 (needs llama_cpp importable)")
    ap.add_argument("--own-quantized", action="store_true", help="with --llama-cpp: also llama.cpp's own q8_0 / Q4_0 "
                    "of every matrix (quantized by llama.cpp; see benchmarks/llama_cpp_rows.py for the build it needs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.new_tokens, args.prefill = 8, 32
    models = [("mixtral-304M" if not args.smoke else "mixtral-smoke", mixtral_shaped(args.smoke))]
    if not args.skip_shipped and not args.smoke:
        models.append(("zoo-tiny-moe", zoo.load("zoo-tiny-moe", convert=False).eval()))
    from moe_gemv import cpu_flags, read_bandwidth

    rows = []
    bandwidth, how, _ = read_bandwidth(args.smoke)
    tokenizer = zoo.load_tokenizer("zoo-tiny-moe")
    for name, model in models:
        rows += run_model(name, model, args.new_tokens, args.prompt, args.prefill, loop=not args.smoke)
        if args.llama_cpp:
            from llama_cpp_rows import rows as llama_rows

            g = torch.Generator().manual_seed(0)
            vocab = model.config.vocab_size
            prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
            prefill = torch.randint(3, vocab, (args.prefill,), generator=torch.Generator().manual_seed(1)).tolist()
            same = same_weights(zoo.convert(copy.deepcopy(model)).eval())
            rows += llama_rows(name, same, tokenizer, prompt, prefill, args.new_tokens, args.threads, args.own_quantized)
    print(f"\n{args.new_tokens} greedy tokens after a {args.prompt}-token prompt, batch 1; prefill {args.prefill} "
          f"tokens; torch threads {args.threads}; ratios to transformers eager bf16 of the same model\nprocessor flags: "
          f"{cpu_flags()}; machine read bandwidth ({how}, {args.threads} threads): {bandwidth:.1f} GB/s")
    head = (f"{'model':14} {'engine':24} {'decode tok/s':>12} {'ratio':>6} {'zoo loop':>8} {'ratio':>6} {'jit loop':>8} "
            f"{'prefill tok/s':>13} {'ratio':>6} {'compile s':>9} {'1st token ms':>12} {'same tokens':>11} "
            f"{'MB/token':>8} {'GB/s':>6} {'of bw':>5}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ref = next(x for x in rows if x["model"] == r["model"] and x["engine"] == "transformers eager")
        same = "-" if r["same"] is None else "yes" if r["same"] else "no"
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        loop = ("-", "-") if r["loop"] is None else (f"{r['loop']:.1f}", f"{r['loop'] / ref['decode']:.2f}")
        jit = "-" if r.get("jit") is None else f"{r['jit']:.1f}"
        gbs = r["bytes"] * max(r["decode"], r["loop"] or 0) / 1e9 if "bytes" in r else None
        traffic = (f"{r['bytes'] / 1e6:8.1f} {gbs:6.1f} {gbs / bandwidth:5.2f}" if gbs is not None
                   else f"{'-':>8} {'-':>6} {'-':>5}")
        print(f"{r['model']:14} {r['engine']:24} {r['decode']:12.1f} {r['decode'] / ref['decode']:6.2f} "
              f"{loop[0]:>8} {loop[1]:>6} {jit:>8} {r['prefill']:13.0f} {r['prefill'] / ref['prefill']:6.2f} {compile_s:>9} {r['first_ms']:12.1f} "
              f"{same:>11} {traffic}")
    print("(MB/token: weight bytes a decode token reads (experts: the top-k share); GB/s: that times the fastest decode\n"
          " column of the row (zoo loop where measured); of bw: its share of the machine's read bandwidth;\n"
          " same tokens: equal to the first engine's greedy tokens; quantized experts may differ by design;\n"
          " zoo loop: zoo.runtime.decode.greedy instead of generate, its step compiled ahead of time (AOTInductor);\n"
          " jit loop: the same loop with the JIT-compiled step generate uses (torch.compile, C++ wrapper);\n"
          " compiled rows read the experts with zoo::moe_gemv, 'torch kernels' rows are the same step without it:\n"
          f" {'kernel ' + kernels.isa() if kernels.ready() else 'kernel unavailable: ' + str(kernels.unavailable_reason())})")
    if not args.smoke:
        same = fp32_tokens_equal(models[0][1], args.prompt, 32)
        print(f"{models[0][0]} in fp32, compiled step vs eager reference, 32 greedy tokens equal: "
              + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in same.items()))
    if not args.llama_cpp:
        print("llama.cpp: not measured in this run (pass --llama-cpp with llama_cpp importable)")
    else:
        print("llama.cpp rows: decode ratios (generate; zoo loop in brackets), zoo row / llama.cpp row: on the same "
              "weights (bf16; the zoo's codes as Q8_0 / Q4_1, experts only or every matrix), and against llama.cpp's "
              "own q8_0 / Q4_0 of every matrix from the bf16 file:")
        for name in dict.fromkeys(r["model"] for r in rows):
            get = {r["engine"]: r for r in rows if r["model"] == name}
            pairs = [("zoo bf16 compiled", "llama.cpp bf16"), ("zoo int8 compiled", "llama.cpp Q8_0 experts"),
                     ("zoo int4 compiled", "llama.cpp Q4_1 experts"), ("zoo int8 all compiled", "llama.cpp Q8_0 all"),
                     ("zoo int4 all compiled", "llama.cpp Q4_1 all"), ("zoo int8 all compiled", "llama.cpp own q8_0"),
                     ("zoo int4 all compiled", "llama.cpp own Q4_0")]
            print(f"  {name}: " + ", ".join(f"{a[4:-9]}/{b[10:]} {get[a]['decode'] / get[b]['decode']:.2f} "
                                            f"({get[a]['loop'] / get[b]['decode']:.2f})"
                                            for a, b in pairs if a in get and b in get and get[a]["loop"]))
    if args.profile:
        model = zoo.convert(copy.deepcopy(models[0][1])).eval()
        quantized = zoo.apply(copy.deepcopy(model), "quantize", bits=4)  # copied before anything compiles
        print("\nprofile of the compiled bf16 decode step (16 steps of the zoo loop):\n" + profile_step(model))
        print("\nprofile of the compiled int4 decode step (16 steps of the zoo loop):\n" + profile_step(quantized))


if __name__ == "__main__":
    main()
