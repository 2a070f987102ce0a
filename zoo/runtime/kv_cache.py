"""Key/value caches at lower precision: ``kv_cache(model, "int8" | "int4" | "fp8")`` for ``model.generate``,
``zoo.decode.greedy(..., kv_cache=...)`` and ``kv_perplexity`` (quality on long contexts, fed a chunk at a time).

"fp8" is transformers' own ``QuantizedCache("fp8")`` (one scale per tensor, frozen at the first update). "int8"
and "int4" are the zoo's: transformers' integer caches need the optimum-quanto or hqq packages. Each token's keys
and values are stored as ``bits``-bit integers in groups of ``group_size`` channels, asymmetric (a float16 scale
and minimum per group), packed two int4 codes per byte. Per token, so a step appends its own tokens' codes and
nothing already stored is quantized twice; the tokens of the current step attend to themselves at full precision
(as transformers' quantized caches do), everything earlier is read back from its codes.
"""
from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

PRECISIONS = ("full", "fp8", "int8", "int4")


def quantize_tokens(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (codes packed along the last dim as uint8, scale, minimum [..., D / group] float16)."""
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((high - low) / levels).clamp(min=1e-8).half()
    low = low.half()
    codes = ((g - low.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8).flatten(-2)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale.squeeze(-1), low.squeeze(-1)


def dequantize_tokens(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    g = codes.float().unflatten(-1, (-1, group))
    return (g * scale.float().unsqueeze(-1) + low.float().unsqueeze(-1)).flatten(-2).to(dtype)


class IntQuantizedLayer(DynamicLayer):
    """One attention layer's keys and values as ``bits``-bit codes per token (see the module's docstring)."""

    is_croppable = False

    def __init__(self, bits: int, group_size: int = 64):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.stored: dict[str, list] = {"keys": [], "values": []}
        self.length = 0

    def _group(self, dim: int) -> int:
        return math.gcd(self.group_size, dim)  # a head dim the group size does not divide: its largest divisor

    def _read(self, name: str, dtype) -> torch.Tensor | None:
        parts = self.stored[name]
        if not parts:
            return None
        codes, scale, low = (torch.cat([p[j] for p in parts], dim=-2) for j in range(3))
        self.stored[name] = [(codes, scale, low)]  # one piece from now on: the next read is one dequantize
        return dequantize_tokens(codes, scale, low, self.bits, self._group(self.head_dim), dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.head_dim = key_states.shape[-1]
        out = []
        for name, new in (("keys", key_states), ("values", value_states)):
            past = self._read(name, new.dtype)
            out.append(new if past is None else torch.cat([past, new], dim=-2))
            self.stored[name].append(quantize_tokens(new, self.bits, self._group(new.shape[-1])))
        self.length += key_states.shape[-2]
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.stored, self.length = {"keys": [], "values": []}, 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.stored.values() for p in parts for t in p)


def kv_cache(model, precision: str = "int8", group_size: int = 64) -> Cache:
    """A fresh cache for ``model``'s next ``generate``/forward with keys and values at ``precision``."""
    check_precision(precision)
    config = model.config.get_text_config(decoder=True)
    if precision == "full":
        return DynamicCache(config=config)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"}:
        raise ValueError(f"a {precision} key/value cache needs full attention in every layer; this model has "
                         f"{sorted(kinds - {'full_attention'})} layers")
    if precision == "fp8":
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache("fp8", model.config)
    bits = int(precision[3:])
    return Cache(layers=[IntQuantizedLayer(bits, group_size) for _ in range(config.num_hidden_layers)])


def check_precision(precision) -> None:
    if precision not in PRECISIONS:
        import difflib

        close = difflib.get_close_matches(str(precision), PRECISIONS, n=1)
        raise ValueError(f"kv cache precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
                         + (f"; did you mean {close[0]!r}?" if close else ""))


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache holds: codes, scales and minimums (int), fp8 states and scales, or full keys and values."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, IntQuantizedLayer):
            total += layer.nbytes()
        elif getattr(layer, "_quantized_keys", None) is not None:  # transformers' fp8 layer: (codes, scale) pairs
            total += sum(t.numel() * t.element_size() for q in (layer._quantized_keys, layer._quantized_values)
                         for t in q)
        elif getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            total += (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
    return total


@torch.no_grad()
def kv_perplexity(model, windows: torch.Tensor, precision: str, chunk: int = 32) -> tuple[float, int]:
    """(perplexity of ``windows [N, T]`` fed ``chunk`` tokens at a time through a ``precision`` cache, the cache's
    bytes after the last window). Every token after the first chunk attends to the earlier ones through the cache,
    so the precision is what it reads; "full" is the same loop at full precision (the comparison's control)."""
    check_precision(precision)
    total, count, size = 0.0, 0, 0
    model.eval()
    for ids in windows.split(1):
        cache = kv_cache(model, precision)
        for start in range(0, ids.shape[1], chunk):
            part = ids[:, start:start + chunk]
            logits = model(input_ids=part, cache=cache, use_cache=True).logits.float()
            targets = ids[:, start + 1:start + 1 + part.shape[1]]  # each token predicts the next, across chunks
            loss = torch.nn.functional.cross_entropy(logits[:, :targets.shape[1]].flatten(0, 1), targets.flatten(),
                                                     reduction="sum")
            total, count = total + float(loss), count + targets.numel()
        size = cache_bytes(cache)
    return math.exp(total / count), size


def kv_cache_table(model, precision: str, windows: int = 8, seq_len: int = 256, chunk: int = 32) -> dict:
    """``kv_perplexity`` at ``precision`` and at full precision on the first ``windows`` held-out windows of each
    corpus domain: {"precision", "windows", "chunk", "domains": {domain: {perplexity, full_perplexity, bytes,
    full_bytes}}}."""
    from zoo.data.corpus import DOMAINS
    from zoo.data.tokens import eval_windows, token_stream
    from zoo.io.loading import tokenizer_for

    check_precision(precision)
    tok = tokenizer_for(model, required=True)
    domains = {}
    for domain in DOMAINS:
        ids = eval_windows(token_stream(domain, "val", tok), seq_len)[:windows]
        ppl, size = kv_perplexity(model, ids, precision, chunk)
        full_ppl, full_size = kv_perplexity(model, ids, "full", chunk)
        domains[domain] = {"perplexity": ppl, "full_perplexity": full_ppl, "bytes": size, "full_bytes": full_size}
    return {"precision": precision, "windows": windows, "chunk": chunk, "domains": domains}
