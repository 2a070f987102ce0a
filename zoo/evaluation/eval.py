"""The zoo's one evaluation harness: perplexity per domain, expert usage, speed, size.

Compressors, cards and demos all report through ``evaluate``.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from zoo.data.corpus import DOMAINS
from zoo.data.tokens import eval_windows, token_stream
from zoo.moe.layout import moe_layers
from zoo.io.loading import check_tokenizer, tokenizer_for
from zoo.components.options import check_int


def check_positions(model, tokens: int, what: str) -> None:
    """``tokens`` positions must fit the model (``config.max_position_embeddings``, when it has one)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise ValueError(f"{what} needs {tokens} positions but the model has only {limit} "
                         "(config.max_position_embeddings)")


def sizes(model) -> dict:
    """Parameters and bytes, total and active per token (experts counted at their layer's k)."""
    layers = moe_layers(model)
    # expert tensors are counted by their kind's num_parameters() (the weights they stand for: packed codes and
    # scales are bytes, not parameters); everything else by numel
    in_experts = {_storage(t) for _, moe in layers for t in [*moe.experts.parameters(), *moe.experts.buffers()]}
    seen, other, nbytes = set(), 0, 0
    for t in list(model.parameters()) + list(model.buffers()):
        if _storage(t) in seen:
            continue  # tied weights count once
        seen.add(_storage(t))
        nbytes += t.numel() * t.element_size()
        other += 0 if _storage(t) in in_experts else t.numel()
    expert_total = sum(moe.experts.num_parameters() for _, moe in layers)
    expert_active = sum(moe.experts.active_parameters(moe.top_k) for _, moe in layers)
    return {"params": other + expert_total, "bytes": nbytes, "active_params": other + expert_active,
            "expert_params": expert_total}


def _storage(t):
    """What identifies a tensor's memory; on the meta device (a streamed model's skeleton) the tensor itself."""
    return id(t) if t.is_meta else t.data_ptr()


class UsageRecorder:
    """Counts which experts each router picks, per layer, while active (forward hooks on routers)."""

    def __init__(self, model):
        self.layers = moe_layers(model)
        self.counts = [torch.zeros(m.num_experts, dtype=torch.long) for _, m in self.layers]
        self._handles = []

    def __enter__(self):
        for slot, (_, moe) in enumerate(self.layers):
            def hook(module, args, routing, slot=slot, n=moe.num_experts):
                idx = routing.indices.reshape(-1)
                self.counts[slot] += torch.bincount(idx[idx < n], minlength=n).cpu()
            self._handles.append(moe.router.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def entropy_bits(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum().clamp(min=1)
    return float(-(p[p > 0] * p[p > 0].log2()).sum())


@torch.no_grad()
def perplexity_and_usage(model, tokenizer, seq_len=256, max_windows=24, batch=8, split="val") -> tuple[dict, dict]:
    """Perplexity per domain of ``split`` (``val``: the held-out documents; ``ood``: text of other origins) and
    the experts each layer routed those tokens to."""
    ppl, usage = {}, {}
    model.eval()
    for domain in DOMAINS:
        windows = eval_windows(token_stream(domain, split, tokenizer), seq_len, max_windows)
        total = count = 0.0
        with UsageRecorder(model) as rec:
            for i in range(0, len(windows), batch):
                ids = windows[i:i + batch].to(model.device)  # (the model may sit on an accelerator)
                loss = model(input_ids=ids, labels=ids).loss.float().item()
                n = ids.numel() - ids.shape[0]
                total, count = total + loss * n, count + n
        ppl[domain] = math.exp(total / count)
        usage[domain] = [{"layer": i, "counts": c.tolist(), "entropy_bits": round(entropy_bits(c), 4),
                          "max_entropy_bits": round(math.log2(len(c)), 4)}
                         for (i, _), c in zip(rec.layers, rec.counts)]
    return ppl, usage


@torch.no_grad()
def speed(model, tokenizer, prompt_tokens=256, new_tokens=32, repeats=3) -> dict:
    """Prefill tok/s (one forward over ``prompt_tokens``) and greedy decode tok/s (after a 16-token prompt)."""
    ids = token_stream("english", "val", tokenizer)[:prompt_tokens].long()[None].to(model.device)
    pre = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(input_ids=ids)
        pre.append(time.perf_counter() - t)
    prompt = ids[:, :16]
    dec = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        dec.append((time.perf_counter() - t) / (out.shape[1] - prompt.shape[1]))
    return {"prefill_tok_s": round(prompt_tokens / statistics.median(pre), 1),
            "decode_tok_s": round(1 / statistics.median(dec), 1), "threads": torch.get_num_threads()}


def evaluate(model, tokenizer=None, seq_len=256, max_windows=24, measure_speed=True, ood=True) -> dict:
    """Everything the zoo reports about a model, as one JSON-able dict: perplexity per domain on the held-out
    split (``perplexity``) and, with ``ood``, on text of other origins (``perplexity_ood``: modern English and
    third-party Python, see the corpus' ATTRIBUTION.md), expert usage, size, speed. ``tokenizer``: the model's own
    by default (``zoo.io.loading.tokenizer_for``); one whose vocabulary does not fit the model is refused."""
    check_int("seq_len", seq_len, 2)
    check_int("max_windows", max_windows, 1)
    check_positions(model, seq_len, f"seq_len {seq_len}")
    if tokenizer is None:
        tokenizer = tokenizer_for(model, required=True)
    else:
        check_tokenizer(tokenizer, model, "the tokenizer given")
    ppl, usage = perplexity_and_usage(model, tokenizer, seq_len, max_windows)
    result = {"perplexity": {d: round(v, 3) for d, v in ppl.items()}, "usage": usage, "size": sizes(model)}
    if ood:
        ppl_ood, _ = perplexity_and_usage(model, tokenizer, seq_len, max_windows, split="ood")
        result["perplexity_ood"] = {d: round(v, 3) for d, v in ppl_ood.items()}
    if measure_speed:
        result["speed"] = speed(model, tokenizer)
    return result


def format_table(results: dict[str, dict]) -> str:
    """Side-by-side text table of several ``evaluate`` results (columns = named results)."""
    names = list(results)
    rows = []
    for d in DOMAINS:
        rows.append((f"ppl {d}", [f"{results[n]['perplexity'][d]:.2f}" for n in names]))
    if all("perplexity_ood" in results[n] for n in names):
        for d in DOMAINS:
            rows.append((f"ppl {d} (out of domain)", [f"{results[n]['perplexity_ood'][d]:.2f}" for n in names]))
    rows.append(("params (M)", [f"{results[n]['size']['params'] / 1e6:.2f}" for n in names]))
    rows.append(("active params (M)", [f"{results[n]['size']['active_params'] / 1e6:.2f}" for n in names]))
    rows.append(("bytes (MB)", [f"{results[n]['size']['bytes'] / 1e6:.1f}" for n in names]))
    for d in DOMAINS:
        ent = [results[n]["usage"][d] for n in names]
        rows.append((f"usage entropy {d} (bits, mean)",
                     [f"{statistics.mean(l['entropy_bits'] for l in e):.2f}/{e[0]['max_entropy_bits']:.2f}" if e
                      else "-" for e in ent]))
    if all("speed" in results[n] for n in names):
        rows.append(("prefill tok/s", [f"{results[n]['speed']['prefill_tok_s']:.0f}" for n in names]))
        rows.append(("decode tok/s", [f"{results[n]['speed']['decode_tok_s']:.1f}" for n in names]))
    width = max(len(r[0]) for r in rows)
    cols = [max(len(n), 10) for n in names]
    lines = [" " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols))]
    lines += [label.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)) for label, vals in rows]
    return "\n".join(lines)


def plot_usage(result: dict, path: str, title: str = "expert usage", overwrite: bool = False) -> str:
    """Heatmaps of routed-token share per layer x expert, one panel per domain, saved as PNG at ``path`` (through
    ``zoo.io.atomic.atomic_file``: an existing file is replaced only with ``overwrite``)."""
    from zoo.io.atomic import atomic_file

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = [d for d in result["usage"] if result["usage"][d]]
    fig, axes = plt.subplots(1, len(domains), figsize=(4.5 * len(domains), 3.2), squeeze=False)
    for ax, d in zip(axes[0], domains):
        layers = result["usage"][d]
        width = max(len(l["counts"]) for l in layers)
        share = torch.zeros(len(layers), width)
        for i, l in enumerate(layers):
            c = torch.tensor(l["counts"], dtype=torch.float)
            share[i, :len(c)] = c / c.sum().clamp(min=1)
        im = ax.imshow(share.numpy(), cmap="viridis", aspect="auto", vmin=0)
        ax.set_title(f"{d} (ppl {result['perplexity'][d]:.1f})")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_xticks(range(width))  # whole experts and layers, never fractional ticks
        ax.set_yticks(range(len(layers)), [str(l["layer"]) for l in layers])
        fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        with atomic_file(path, overwrite) as staged:
            fig.savefig(staged, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path
