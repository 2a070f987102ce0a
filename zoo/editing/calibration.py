"""Calibration data for compressors: texts, token batches, or a slice of the shipped corpus by domain."""
from __future__ import annotations

import numbers

import torch

from zoo.data.corpus import DOMAINS


def corpus(domain: str = "mixed", tokens: int = 16384, seq_len: int = 256, seed: int = 0) -> dict:
    """A calibration spec: ``tokens`` tokens of the corpus' *train* split (never the held-out one), at most as many as
    the split has bytes (a byte-level tokenizer never gives more tokens than bytes): a larger count is refused here,
    before minutes of drawing windows."""
    if domain not in (*DOMAINS, "mixed"):
        raise ValueError(f"domain must be one of {(*DOMAINS, 'mixed')}, got {domain!r}")
    for name, value in (("tokens", tokens), ("seq_len", seq_len), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"calibration {name} must be a whole number, got {value!r}")
    limit = corpus_tokens_limit(domain)
    if tokens > limit:
        raise ValueError(f"calibration tokens={tokens} is more than the {domain} training text holds (at most {limit} "
                         "tokens); give fewer, or pass your own token batches")
    if not 2 <= seq_len <= limit:
        raise ValueError(f"calibration seq_len must be in [2, {limit}], got {seq_len}")
    return {"domain": domain, "tokens": int(tokens), "seq_len": int(seq_len), "seed": int(seed)}


def corpus_tokens_limit(domain: str) -> int:
    """The train split's bytes of ``domain`` (both for ``mixed``): a bound on the tokens it tokenizes to."""
    from zoo.data.corpus import load_manifest

    splits = load_manifest()["splits"]
    return sum(splits[f"{d}/train"]["bytes"] for d in (DOMAINS if domain == "mixed" else (domain,)))


SPEC_KEYS = ("domain", "tokens", "seq_len", "seed")
SOURCE = "moe-zoo shipped corpus, train split"  # what a corpus spec draws from (zoo/_data/corpus)


def default() -> dict:
    """The calibration a component that calibrates gets when none is given: 8192 tokens of both domains."""
    return corpus("mixed", tokens=8192)


def used(calibration, component):
    """The calibration ``component`` actually runs on: the one given, or the default for a component that
    calibrates (and layer by layer takes inputs); None for one that does not calibrate and got none."""
    if calibration is None and getattr(component, "inputs_for", ()):
        return default()
    return calibration


def needs_tokenizer(calibration) -> bool:
    """Whether the calibration data is text (a corpus spec or texts) rather than token ids."""
    return isinstance(calibration, (dict, str)) or (isinstance(calibration, (list, tuple)) and bool(calibration)
                                                   and all(isinstance(t, str) for t in calibration))


def tokens_used(spec: dict) -> int:
    """The tokens a corpus spec gives: whole rows of ``seq_len`` (at least one)."""
    spec = corpus(**spec)
    return max(1, spec["tokens"] // spec["seq_len"]) * spec["seq_len"]


def check_memory(tokens: int, hidden_size: int, dtype) -> None:
    """Calibration keeps every token's hidden state of the current layer, in and out: refused up front when that
    is more than the memory available now."""
    from zoo.io.memory import available_memory

    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    need, have = 2 * tokens * hidden_size * itemsize, available_memory()
    if need > have:
        raise ValueError(f"calibration on {tokens} tokens keeps {need / 1e9:.1f} GB of hidden states, more than the "
                         f"{have / 1e9:.1f} GB of memory available: give fewer tokens")


def check(calibration, vocab_size: int | None = None) -> None:
    """Refuse calibration data that would calibrate on nothing or on garbage, before any work: an empty list,
    blank texts, unknown spec keys, non-integer or empty token batches, ids outside the vocabulary."""
    if calibration is None:
        return
    if isinstance(calibration, dict):
        unknown = sorted(set(calibration) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"unknown calibration spec keys {unknown} (accepted: {', '.join(SPEC_KEYS)})")
        spec = corpus(**calibration)
        if spec["tokens"] < 1 or spec["seq_len"] < 2:
            raise ValueError(f"calibration needs tokens >= 1 and seq_len >= 2, got {spec['tokens']}, {spec['seq_len']}")
        return
    if isinstance(calibration, (list, tuple)) and not calibration:
        raise ValueError("calibration data is empty: pass texts, token batches or zoo.editing.calibration.corpus(...)")
    if isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and all(isinstance(t, str)
                                                                                     for t in calibration)):
        texts = [calibration] if isinstance(calibration, str) else calibration
        if not any(t.strip() for t in texts):
            raise ValueError("calibration texts are all empty")
        return
    tensors = [calibration] if torch.is_tensor(calibration) else calibration
    if not isinstance(tensors, (list, tuple)) or not all(torch.is_tensor(t) for t in tensors):
        return  # a component's own format (e.g. multimodal batches): the component checks it
    for i, t in enumerate(tensors):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"calibration batch {i} holds {t.dtype}; token ids must be an integer tensor")
        if t.dim() not in (1, 2) or t.numel() == 0:
            raise ValueError(f"calibration batch {i} has shape {tuple(t.shape)}; expected [batch, seq] token ids")
    check_ids(tensors, vocab_size)


def check_ids(batches, vocab_size: int | None) -> None:
    """Token ids must index the model's embedding table."""
    if vocab_size is None:
        return
    for i, t in enumerate(batches):
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"calibration batch {i} has token ids in [{low}, {high}] but the model's vocabulary "
                             f"has {vocab_size} entries (is the tokenizer the model's own?)")


def batches(calibration, tokenizer=None, batch_size: int = 8) -> list[torch.Tensor]:
    """Turn any accepted calibration value into a list of LongTensor batches ``[B, S]``.

    Accepted: a spec from ``corpus(...)`` (a dict), a list of texts (needs ``tokenizer``), a LongTensor
    ``[B, S]`` or a list of them.
    """
    if calibration is None:
        raise ValueError("this component needs calibration data: pass calibration=zoo.editing.calibration.corpus(...)")
    check(calibration)
    if isinstance(calibration, dict):
        rows = _corpus_rows(calibration, tokenizer)
    elif torch.is_tensor(calibration):
        rows = calibration.long()
    elif isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and calibration
                                          and all(isinstance(t, str) for t in calibration)):
        texts = [calibration] if isinstance(calibration, str) else list(calibration)
        tok = tokenizer or _default_tokenizer()
        return [torch.tensor([ids]) for ids in tok(texts)["input_ids"] if ids]
    elif isinstance(calibration, (list, tuple)) and all(torch.is_tensor(t) for t in calibration):
        return [t.long() if t.dim() == 2 else t.long()[None] for t in calibration]
    else:
        raise TypeError(f"unsupported calibration data {type(calibration).__name__}: pass "
                        "zoo.editing.calibration.corpus(domain, tokens), texts, or token batches")
    return list(rows.split(batch_size))


def _corpus_rows(spec: dict, tokenizer) -> torch.Tensor:
    from zoo.data.tokens import token_stream

    spec = corpus(**spec)
    domains = DOMAINS if spec["domain"] == "mixed" else (spec["domain"],)
    n_rows = tokens_used(spec) // spec["seq_len"]
    g = torch.Generator().manual_seed(spec["seed"])
    rows = []
    for i in range(n_rows):
        stream = token_stream(domains[i % len(domains)], "train", tokenizer or _default_tokenizer())
        start = int(torch.randint(0, len(stream) - spec["seq_len"], (1,), generator=g))
        rows.append(stream[start:start + spec["seq_len"]])
    return torch.stack(rows).long()


def _default_tokenizer():
    from zoo.data.tokenizer import load_tokenizer

    return load_tokenizer()
