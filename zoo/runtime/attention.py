"""Attention for compiled decode: the model's own eager attention for one query, SDPA for more.

A decode step attends one query over the static cache. torch's SDPA kernel for CPU spends far more on that call
than the arithmetic (16 heads, 4 key/value heads, head size 64, bf16, 2 threads: 233 us over 128 positions, 474 us
over 256), while the family's eager attention (two matmuls and a softmax) is fused by inductor into the step. The
ahead-of-time step exports with the eager implementation (``zoo.runtime.decode_aot.STEP_ATTENTION``); the JIT step
(``greedy(..., ahead_of_time=False)``) and ``generate`` run prefill and steps through one attention setting, so
they take this one: the same step, and the prompt still on SDPA. Registered with transformers'
``AttentionInterface`` as ``DECODE_ATTENTION``; a family without an ``eager_attention_forward`` of its own keeps
SDPA throughout.
"""
from __future__ import annotations

import contextlib
import sys

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

DECODE_ATTENTION = "zoo_decode"


def decode_attention(module, query, key, value, attention_mask, **kwargs):
    """``query [B, H, q, D]``: for q == 1 the attention module's family's ``eager_attention_forward``, else SDPA."""
    if query.shape[2] == 1:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Make ``DECODE_ATTENTION`` a name transformers knows (idempotent), with the eager masks (additive floats, which
    both the eager attention and SDPA read); the name."""
    if DECODE_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    if DECODE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(DECODE_ATTENTION, eager_mask)
    return DECODE_ATTENTION


@contextlib.contextmanager
def attention(model, implementation: str):
    """The model's attention implementation set to ``implementation`` for a while, where the model had SDPA
    (flash, flex or a family's own stay as they are)."""
    before = model.config._attn_implementation
    switch = before == "sdpa"
    if switch:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(before)
