"""Benchmark: zoo's SparseMoE forward against transformers' MixtralSparseMoeBlock, same weights.

For each token count T and dtype it builds one Mixtral MoE block (H=1024, I=2816, 8 experts, top-2)
with seeded weights, runs it through transformers' ``eager`` and ``grouped_mm`` experts implementations
and through ``zoo.moe.SparseMoE`` (made by ``Mixtral().from_native``), checks that the three outputs
agree, then times each forward under ``torch.inference_mode()``: warm-up runs, then the median of
repeats (the three take turns; at least 5, else about 1.5 s of measuring per cell, see ``--budget``).

    python benchmarks/moe_block.py                      # full table (several minutes on 2 cores)
    python benchmarks/moe_block.py --tokens 1 128 --dtypes bf16
    python benchmarks/moe_block.py --smoke              # tiny shapes, one repeat, a few seconds

The zoo block also runs with ``experts_implementation="grouped_mm"`` (transformers' function on the zoo's experts:
column zoo+gmm). The last line reports whether zoo / min(eager, grouped_mm) <= 0.95 held in every cell (report
only).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import zoo  # noqa: F401  (loads the plugins)
from zoo.architectures.mixtral import Mixtral

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-4, "bf16": 3e-2}  # atol (and rtol for bf16) of the agreement check
TARGET = 0.95


def build(hidden: int, inter: int, experts: int = 8, top_k: int = 2, seed: int = 0):
    """Native eager and grouped_mm blocks and a zoo SparseMoE, all holding the same fp32 weights."""
    blocks = {}
    for impl in ("eager", "grouped_mm"):
        # MixtralExperts dispatches on ``config._experts_implementation`` at every forward call,
        # so each variant needs its own config object.
        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                            num_experts_per_tok=top_k, experts_implementation=impl)
        assert cfg._experts_implementation == impl
        blocks[impl] = MixtralSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    eager = blocks["eager"]
    with torch.no_grad():
        eager.experts.gate_up_proj.normal_(0.0, 0.02, generator=g)
        eager.experts.down_proj.normal_(0.0, 0.02, generator=g)
        eager.gate.weight.normal_(0.0, 0.5, generator=g)  # wide router: tokens spread over experts
    blocks["grouped_mm"].load_state_dict(eager.state_dict())
    blocks["zoo"] = Mixtral().from_native(eager, eager.experts.config).eval()
    # the zoo block running its experts by transformers' grouped_mm (``experts_implementation="grouped_mm"``)
    blocks["zoo_grouped_mm"] = blocks["zoo"].with_parts()
    blocks["zoo_grouped_mm"].experts_implementation = "grouped_mm"
    return blocks


def median_ms(blocks: dict, x, warmup: int, repeats: int | None, budget_s: float) -> dict:
    """Median forward time of each block in ms. The blocks take turns (in a rotating order) within each
    repeat, so drift in machine speed hits all of them alike."""
    for _ in range(warmup):
        for b in blocks.values():
            b(x)
    if repeats is None:  # size the repeats from one timed round
        t0 = time.perf_counter()
        for b in blocks.values():
            b(x)
        repeats = max(5, min(200, round(budget_s / max(time.perf_counter() - t0, 1e-6))))
    names, times = list(blocks), {k: [] for k in blocks}
    for i in range(repeats):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            blocks[k](x)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 2048])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="H=64, I=96, T in {1, 16}, one repeat")
    p.add_argument("--budget", type=float, default=1.5, help="seconds of timed repeats per cell (at least 5)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    hidden, inter = (64, 96) if args.smoke else (1024, 2816)
    tokens = [1, 16] if args.smoke else args.tokens
    warmup, repeats = (1, 1) if args.smoke else (2, None)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, H={hidden}, I={inter}, E=8, top-2")

    rows, met = [], True
    with torch.inference_mode():
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            blocks = {k: b.to(dtype) for k, b in build(hidden, inter).items()}  # same seed: same weights
            for t in tokens:
                x = torch.randn(1, t, hidden, generator=torch.Generator().manual_seed(t)).to(dtype)
                outs = {k: b(x) for k, b in blocks.items()}
                ref = outs["eager"].float()
                diffs = {k: (outs[k].float() - ref).abs().max().item()
                         for k in ("grouped_mm", "zoo", "zoo_grouped_mm")}
                print(f"check T={t:<5} {dname}: max|grouped_mm-eager|={diffs['grouped_mm']:.2e} "
                      f"max|zoo-eager|={diffs['zoo']:.2e} max|zoo_grouped_mm-eager|={diffs['zoo_grouped_mm']:.2e}",
                      flush=True)
                rtol = TOL[dname] if dname == "bf16" else 0.0
                for k in ("grouped_mm", "zoo", "zoo_grouped_mm"):
                    torch.testing.assert_close(outs[k].float(), ref, atol=TOL[dname], rtol=rtol,
                                               msg=lambda m, k=k: f"{k} vs eager, T={t} {dname}: {m}")
                ms = median_ms(blocks, x, warmup, repeats, args.budget)
                ratio = ms["zoo"] / min(ms["eager"], ms["grouped_mm"])
                met &= ratio <= TARGET
                rows.append((t, dname, ms["eager"], ms["grouped_mm"], ms["zoo"], ms["zoo_grouped_mm"], ratio,
                             ms["grouped_mm"] / ms["eager"], ms["zoo_grouped_mm"] / ms["zoo"]))

    head = ("T", "dtype", "eager ms", "grouped_mm ms", "zoo ms", "zoo+gmm ms", "zoo/min(native)",
            "grouped_mm/eager", "zoo+gmm/zoo")
    print()
    print(f"{head[0]:>5} {head[1]:>5} {head[2]:>10} {head[3]:>14} {head[4]:>10} {head[5]:>11} {head[6]:>16} "
          f"{head[7]:>17} {head[8]:>12}")
    for t, d, e, g, z, zg, r, ge, zgz in rows:
        print(f"{t:>5} {d:>5} {e:>10.3f} {g:>14.3f} {z:>10.3f} {zg:>11.3f} {r:>16.3f} {ge:>17.3f} {zgz:>12.3f}")
    print(f"\nzoo target ratio <= {TARGET} at every cell: {'MET' if met else 'NOT MET'}"
          + ("" if met else f" (worst {max(r[6] for r in rows):.3f})"))


if __name__ == "__main__":
    main()
