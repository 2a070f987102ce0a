"""Fast CPU decode that stays a transformers citizen: a static KV cache and a ``torch.compile``d decode
step, through the standard ``model.generate``.

transformers compiles the decode step itself when the cache is static and a ``CompileConfig`` is given;
on CPU it must be told to (``_compile_all_devices``). Prefill runs eagerly (many tokens: the sorted
dispatch); each decode step (one token per sequence) runs compiled as one graph (``fullgraph=True``
enforces it): experts read the selected experts' weights in place through the zoo's own kernel, an op the
compiler does not trace (``zoo.moe.kernels``: ``zoo::moe_gemv``, built on first use). Where it cannot be built,
dense experts gather the selected weights (no host sync) and quantized ones call torch's low-bit kernels on
views (``zoo.moe.in_place``). ``generate`` and ``greedy`` also let the kernel read the large plain linear layers
(attention projections, LM head: ``zoo.moe.kernels.linear``).
"""
from __future__ import annotations

import numbers
import statistics
import time
import warnings
from contextlib import nullcontext

import torch
from transformers import CompileConfig, StaticCache

from zoo.moe import kernels
from zoo.moe.kernels.linear import read_linears_with_kernel
from zoo.runtime.attention import attention, register as register_decode_attention
from zoo.runtime.realize_query import RealizeOneRowBmmInputs


def compile_config(backend: str = "inductor", fullgraph: bool = True, cpp_wrapper: bool = True) -> CompileConfig:
    """A CompileConfig for CPU decode: one graph per step (no CUDA graphs, static shapes). Inductor also
    turns one-row matmuls with small weights (attention projections) into its own fused reductions
    (``decompose_mm_pass``), which read the weights faster than the library matmul for one row. With
    ``cpp_wrapper`` inductor drives the step's kernels from generated C++ instead of generated Python (304M
    benchmark model, 2 threads, one run: decode 56.7 -> 57.7 tok/s in bf16, 107.7 -> 118.5 with int4 experts,
    the same tokens; compiling takes up to twice as long). The one query's row is computed once before its
    attention scores (``zoo.runtime.realize_query``)."""
    kernels.load()  # the zoo's expert kernel (built on first use), which the compiled step then calls
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {}},
               "post_grad_custom_post_pass": RealizeOneRowBmmInputs()} if backend == "inductor" else None
    if backend == "inductor" and cpp_wrapper:
        options["cpp_wrapper"] = True
    # mode=None: torch.compile takes a mode or options, not both ("default" is what no mode means)
    config = CompileConfig(fullgraph=fullgraph, dynamic=False, backend=backend, mode=None, options=options)
    config._compile_all_devices = True  # transformers only auto-compiles on accelerators unless told
    return config


def check_decode(model, input_ids, max_new_tokens) -> None:
    """A prompt of at least one token, at least one new token, and room for both in the model's positions
    (a static cache of a huge length would try to allocate it all): ValueError before any work."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, tokens] tensor with at least one token, got {shape}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) if hasattr(model, "get_input_embeddings") \
        else None
    if isinstance(vocab, int) and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids hold token ids in [{low}, {high}] but the model's vocabulary has {vocab} "
                             f"ids (0 to {vocab - 1}): is the tokenizer the model's own?")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) and max_new_tokens ({max_new_tokens}) need "
                         f"{input_ids.shape[1] + max_new_tokens} positions but the model has only {limit} "
                         "(config.max_position_embeddings)")


# greedy's static cache (and so its compiled step) is as long as the prompt and the new tokens rounded up to a multiple
# of this: every call whose prompt and length fall in one bucket reuses one compiled step, where an exact length
# compiled anew for each (an AOTInductor build took 20-60 s a length on the 304M benchmark model). The longer cache
# costs the step a masked read of the unused positions' keys and values (4 KB a position a layer there, against
# 176 MB of weights a token).
CACHE_BUCKET = 256


def cache_length(model, needed: int) -> int:
    """The static cache length for ``needed`` positions: rounded up to a multiple of ``CACHE_BUCKET``, at most the
    model's ``max_position_embeddings`` (``check_decode`` has checked that ``needed`` fits)."""
    bucketed = -(-needed // CACHE_BUCKET) * CACHE_BUCKET
    limit = getattr(model.config, "max_position_embeddings", None)
    return max(needed, min(bucketed, limit)) if isinstance(limit, int) else bucketed


def check_compilable(model) -> None:
    """ValueError, in one line, for a model with modules that only run eagerly (they set ``eager_only_reason``, e.g.
    ``zoo.offload``'s experts), before a compiled decode would fail inside the compiler."""
    for module in model.modules():
        reason = getattr(module, "eager_only_reason", None)
        if reason:
            raise ValueError(f"this model's {reason}: decode it with compile=False")


def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, compile: bool = True,
             backend: str = "inductor", **kwargs) -> torch.Tensor:
    """Greedy (unless ``kwargs`` say otherwise) generation with a static cache and, if ``compile``, the
    compiled decode step. Equivalent to ``model.generate(..., cache_implementation="static",
    compile_config=zoo.runtime.decode.compile_config())``."""
    check_decode(model, input_ids, max_new_tokens)
    if compile:
        check_compilable(model)
    kwargs.setdefault("do_sample", False)
    if compile and kernels.load():
        read_linears_with_kernel(model)
    if not compile:
        return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
    kwargs.update(cache_implementation="static", compile_config=compile_config(backend))
    with attention(model, register_decode_attention()):  # the steps' one query on eager attention, not SDPA
        return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)


def next_token(logits: torch.Tensor) -> torch.Tensor:
    """The greedy choice ``[B, 1]`` from ``logits [B, S, V]``'s last position (the first of equal maxima, as
    ``argmax``). On CPU through numpy: torch's argmax over a bf16 row of 8192 took ~45 us, numpy's ~10 us, in a
    decode step of ~1.2 ms (zoo-tiny-moe)."""
    last = logits[:, -1]
    if last.device.type != "cpu":
        return last.argmax(-1, keepdim=True)
    return torch.from_numpy(last.float().numpy().argmax(-1)).view(-1, 1)


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, max_new_tokens: int = 64, compile: bool = True,
           backend: str = "inductor", eos_token_id: int | None = None, ahead_of_time: bool = True,
           kv_cache: str | None = None) -> torch.Tensor:
    """The same decode without ``generate``'s per-step bookkeeping (logits processors, stopping criteria,
    input preparation): eager prefill into a ``StaticCache``, then one compiled decode step per token. Greedy;
    with ``eos_token_id`` it stops once every sequence has produced it (finished ones are padded with it, as
    ``generate`` does when no pad token is set).

    The cache is as long as the prompt and the new tokens rounded up to a multiple of ``CACHE_BUCKET`` positions, so
    prompts and lengths within one bucket share one compiled step. The step: with ``ahead_of_time`` (inductor only), the model's one-token forward compiled ahead of time by
    AOTInductor and run as one C++ call (``zoo.runtime.decode_aot``: the same tokens, 1.05-1.2x the JIT step's speed
    measured on the 304M benchmark model and zoo-tiny-moe); where it cannot be exported, a warning and the JIT
    step: the model's own compiled call (``get_compiled_call``, the one ``generate`` compiles). After the JIT
    step's first call its guards are not evaluated again (``skip_guard_eval_unsafe``): every later step passes
    inputs of the same kinds and shapes, so the guards could only pass, and checking them costs ~0.5 ms a step.

    ``kv_cache`` ("fp8", "int8", "int4"; ``zoo.runtime.kv_cache``): keys and values kept at that precision in a
    cache that grows as it goes, so every step runs eagerly (``compile`` does not apply)."""
    check_decode(model, input_ids, max_new_tokens)
    if kv_cache is not None:
        return _greedy_quantized_cache(model, input_ids, max_new_tokens, eos_token_id, kv_cache)
    if compile:
        check_compilable(model)
    if compile and kernels.load():
        read_linears_with_kernel(model)
    prompt = input_ids.shape[1]
    length = cache_length(model, prompt + max_new_tokens)
    aot = ahead_of_time_step(model, input_ids.shape[0], length) \
        if compile and ahead_of_time and backend == "inductor" else None
    cache = StaticCache(config=model.config, max_cache_len=length)
    logits = model(input_ids=input_ids, past_key_values=cache, cache_position=torch.arange(prompt),
                   use_cache=True, logits_to_keep=1).logits
    jit = model.get_compiled_call(compile_config(backend)) if compile and aot is None else model.__call__
    # the JIT step's one query on the family's eager attention, which inductor fuses (zoo.runtime.attention)
    step_attention = attention(model, register_decode_attention()) if compile and aot is None else nullcontext()
    tokens = [next_token(logits)]
    done = None if eos_token_id is None else tokens[0] == eos_token_id
    with step_attention:
        for i in range(max_new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            if aot is not None:
                logits = aot(tokens[-1], prompt + i, cache)
            else:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=compile and i > 0):
                    logits = jit(input_ids=tokens[-1], past_key_values=cache,
                                 cache_position=torch.tensor([prompt + i]), use_cache=True, logits_to_keep=1).logits
            token = next_token(logits)
            if done is not None:
                token = token.masked_fill(done, eos_token_id)
                done = done | (token == eos_token_id)
            tokens.append(token)
    return torch.cat([input_ids, *tokens], dim=1)


@torch.no_grad()
def _greedy_quantized_cache(model, input_ids, max_new_tokens, eos_token_id, precision) -> torch.Tensor:
    from zoo.runtime.kv_cache import kv_cache

    cache = kv_cache(model, precision)
    logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    tokens = [next_token(logits)]
    done = None if eos_token_id is None else tokens[0] == eos_token_id
    for _ in range(max_new_tokens - 1):
        if done is not None and bool(done.all()):
            break
        token = next_token(model(input_ids=tokens[-1], cache=cache, use_cache=True, logits_to_keep=1).logits)
        if done is not None:
            token = token.masked_fill(done, eos_token_id)
            done = done | (token == eos_token_id)
        tokens.append(token)
    return torch.cat([input_ids, *tokens], dim=1)


def ahead_of_time_step(model, batch: int, max_cache_len: int):
    """The model's AOTInductor step (``zoo.runtime.decode_aot.AotStep``), or None, with a warning saying why, where it
    cannot be exported (the JIT step serves)."""
    from zoo.runtime.decode_aot import AotStep, NotExportable

    try:
        return AotStep.of(model, batch, max_cache_len)
    except NotExportable as exc:
        warnings.warn(f"decode step not compiled ahead of time ({exc}); the JIT-compiled step serves", stacklevel=3)
        return None


def _timed(decode, input_ids: torch.Tensor, new_tokens: int, repeats: int = 3) -> dict:
    """Decode speed, measured honestly: one warm-up run (which compiles; its time is reported apart), then
    ``repeats`` pairs of a prefill-only run (1 new token) and a full run; decode tok/s comes from the
    difference within a pair, and the median pair is reported (this machine's speed drifts between runs).
    ``decode(n)`` generates up to n new tokens (fewer if it stops at EOS: the tokens made are counted)."""
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")

    def clock(n):
        t0 = time.perf_counter()
        out = decode(n)
        return out, time.perf_counter() - t0

    out, warmup = clock(new_tokens)
    firsts, speeds = [], []
    for _ in range(repeats):
        _, first = clock(1)
        out, total = clock(new_tokens)
        firsts.append(first)
        made = out.shape[1] - input_ids.shape[1]
        speeds.append((made - 1) * input_ids.shape[0] / max(total - first, 1e-9))
    return {"tokens": out, "warmup_s": warmup, "first_token_s": statistics.median(firsts),
            "decode_tok_s": statistics.median(speeds)}


def timed_greedy(model, input_ids: torch.Tensor, new_tokens: int, compile: bool = True, repeats: int = 3,
                 eos_token_id: int | None = None, ahead_of_time: bool = True, kv_cache: str | None = None) -> dict:
    """``greedy``'s decode speed, measured as ``timed_generate`` measures generate's."""
    return _timed(lambda n: greedy(model, input_ids, n, compile, eos_token_id=eos_token_id,
                                   ahead_of_time=ahead_of_time, kv_cache=kv_cache), input_ids, new_tokens, repeats)


def timed_generate(model, input_ids: torch.Tensor, new_tokens: int, compile: bool = True, repeats: int = 3,
                   **kwargs) -> dict:
    """``generate``'s decode speed (greedy unless ``kwargs`` say otherwise), with exactly n new tokens."""
    return _timed(lambda n: generate(model, input_ids, max_new_tokens=n, min_new_tokens=n, compile=compile, **kwargs),
                  input_ids, new_tokens, repeats)
