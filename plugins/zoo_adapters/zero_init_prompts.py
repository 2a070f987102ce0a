"""The module zero-init-attention puts around a decoder layer's self-attention: learnable adaption prompts whose
keys and values join the attention of the layer's tokens (LLaMA-Adapter, Zhang et al. 2023).

Per layer, ``n`` prompt vectors ``P [n, H]`` go through the layer's own key and value projections (its norms,
biases and head layout included; no rotary position: a prompt has no place in the sequence) and every token attends
to them. ``attention="zero-init"``: the prompts' scores are softmaxed on their own, apart from the tokens', and
scaled per head by ``tanh(g)`` with the gate ``g`` starting at 0, so the layer starts as it was,

    out_h = softmax(q K_tok^T s) V_tok + tanh(g_h) softmax(q K_P^T s) V_P        (s: the attention's scaling)

``attention="vanilla"``: one softmax over prompts and tokens together, no gate (prefix tuning; the control the
zero-init analysis compares with): ``out = softmax([q K_P^T, q K_tok^T] s) [V_P; V_tok]``.

Prompts: ``"linear"``, free parameters ``P`` (standard normal, as the official code's embedding); ``"non-linear"``,
``P = W_2 relu(W_1 e + b_1) + b_2`` reshaped to ``[n, H]`` from a learnable vector ``e`` (the analysis' prompt
generator, its output layer starting tiny).

How the family's attention is reached: the wrapped attention reads its config through ``AttentionView``, which
names the attention function ``zoo-zero-init`` (registered in transformers' ``AttentionInterface``); that function
runs the model's own implementation (eager, sdpa, ...) for the tokens and adds the prompts. So the queries are exactly
the family's (rotary, q-norms and all), and the keys of the prompts come from one call of the attention itself on
``P`` with rotary set to the identity, whose keys and values the same function records.
"""
from __future__ import annotations

import math
import sys
from functools import partial

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ADAPTER = "zero-init-attention"  # the component's name, recorded in each wrapped attention's spec

IMPLEMENTATION = "zoo-zero-init"
KINDS = ("linear", "non-linear")
ATTENTIONS = ("zero-init", "vanilla")


class AttentionView:
    """The model's config as one wrapped attention sees it: every attribute read from (and written to) the model's
    own config, live, except ``_attn_implementation``, which names ``zoo-zero-init``."""

    _attn_implementation = IMPLEMENTATION

    def __init__(self, config):
        object.__setattr__(self, "base", config)

    def __getattr__(self, name):
        if name == "base":  # not set yet (copy / unpickle build the object before its __dict__)
            raise AttributeError(name)
        return getattr(self.base, name)

    def __setattr__(self, name, value):
        setattr(self.base, name, value)


def family_eager(module):
    """The family's own eager attention function (gpt-oss's adds its sinks), the fallback the family names."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward")


def prompted_attention(module, query, key, value, attention_mask, zoo_prompts=None, **kwargs):
    """``zoo-zero-init``: the model's own attention implementation, with the prompts of ``zoo_prompts`` (a callable
    the wrapper passes through the attention's keyword arguments) added; without it, the plain implementation."""
    config = module.config.base if isinstance(module.config, AttentionView) else module.config
    own = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, family_eager(module))
    if zoo_prompts is None:
        return own(module, query, key, value, attention_mask, **kwargs)
    return zoo_prompts(own, module, query, key, value, attention_mask, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, prompted_attention)


def identity_rotary(position_embeddings, n: int):
    """Rotary embeddings that leave ``n`` positions unrotated: cos 1 and sin 0 (or a complex 1), in the shape and
    dtype of the ones the layer received."""
    if position_embeddings is None:
        return None
    if torch.is_tensor(position_embeddings):  # a complex frequency table (one tensor)
        return torch.ones((1, n, *position_embeddings.shape[2:]), dtype=position_embeddings.dtype,
                          device=position_embeddings.device)
    cos, sin = position_embeddings
    shape = (1, n, *cos.shape[2:])
    return torch.ones(shape, dtype=cos.dtype, device=cos.device), torch.zeros(shape, dtype=sin.dtype, device=sin.device)


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, kv_heads, n, d]`` -> ``[B, heads, n, d]`` (grouped-query attention: each kv head serves a group)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def token_bias(attention_mask, q_len: int, k_len: int, device) -> torch.Tensor | None:
    """The additive float mask the tokens' scores get: a boolean mask (True: attend) or a float one as given;
    none given with several queries is causal from the first key on, as SDPA reads it; one query sees every key."""
    if attention_mask is None:
        if q_len == 1:
            return None
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
        return torch.zeros(q_len, k_len, device=device).masked_fill(~causal, -math.inf)
    mask = attention_mask[..., :k_len]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=device).masked_fill(~mask, -math.inf)
    return mask.float()


class PromptedAttention(nn.Module):
    """A family's self-attention with ``num_prompts`` adaption prompts (see the module docstring)."""

    def __init__(self, attention: nn.Module, hidden_size: int, heads: int, num_prompts: int, prompt: str,
                 attention_kind: str, hidden: int, gate_init: float = 0.0):
        super().__init__()
        like = next(p for p in attention.parameters() if p.is_floating_point())
        like = {"dtype": like.dtype, "device": like.device}
        self.hidden_size, self.heads, self.num_prompts = hidden_size, heads, num_prompts
        self.prompt, self.attention_kind, self.hidden, self.gate_init = prompt, attention_kind, hidden, float(gate_init)
        if prompt == "linear":
            self.prompts = nn.Parameter(torch.empty(num_prompts, hidden_size, **like))
        else:
            self.seed = nn.Parameter(torch.empty(hidden, **like))
            self.generator = nn.Sequential(nn.Linear(hidden, hidden, **like), nn.ReLU(),
                                           nn.Linear(hidden, num_prompts * hidden_size, **like))
        self.gate = nn.Parameter(torch.empty(heads, **like)) if attention_kind == "zero-init" else None
        self.reset()
        if not isinstance(attention.config, AttentionView):
            attention.config = AttentionView(attention.config)
        self.attention = attention

    def reset(self, fill=None) -> None:
        """Initialise the prompt parameters and the gate (``fill``: transformers' initialisers on a load, which skip
        what the checkpoint filled)."""
        fill = fill or nn.init
        if self.prompt == "linear":
            fill.normal_(self.prompts)  # the official code's prompts: an nn.Embedding, N(0, 1)
        else:
            fill.normal_(self.seed)
            first, last = self.generator[0], self.generator[2]
            bound = 1 / math.sqrt(self.hidden)  # nn.Linear's own default for the hidden layer
            fill.uniform_(first.weight, -bound, bound)
            fill.uniform_(first.bias, -bound, bound)
            # the analysis' code starts the output layer tiny (uniform, 1e-3 of a fan-in scale), its bias at zero
            bound = 1e-3 * math.sqrt(3 / (self.hidden * self.hidden_size))
            fill.uniform_(last.weight, -bound, bound)
            fill.zeros_(last.bias)
        if self.gate is not None:
            fill.constant_(self.gate, self.gate_init)

    def init_weights(self, std: float) -> None:
        self.reset(init)

    def zoo_spec(self) -> dict:
        return {"adapter": ADAPTER, "prompts": self.num_prompts, "prompt": self.prompt,
                "attention": self.attention_kind, "hidden": self.hidden, "gate_init": self.gate_init}

    def prompt_vectors(self) -> torch.Tensor:
        """``P [n, H]``: the free prompts, or the generator's output."""
        if self.prompt == "linear":
            return self.prompts
        return self.generator(self.seed).view(self.num_prompts, self.hidden_size)

    def prompt_states(self, position_embeddings):
        """The prompts' keys and values ``[1, kv_heads, n, d]``, made by the attention itself (rotary: identity)."""
        captured = []

        def record(own, module, query, key, value, attention_mask, **kwargs):
            captured.append((key, value))
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

        self.attention(hidden_states=self.prompt_vectors()[None],
                       position_embeddings=identity_rotary(position_embeddings, self.num_prompts),
                       attention_mask=None, zoo_prompts=record)
        return captured[0]

    def forward(self, *args, **kwargs):
        rotary = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        keys, values = self.prompt_states(rotary)
        attend = self.zero_init if self.gate is not None else self.vanilla
        return self.attention(*args, zoo_prompts=partial(attend, keys, values), **kwargs)

    def scores(self, query, keys, scaling):
        return torch.matmul(query.float(), expand_heads(keys, query.shape[1]).float().transpose(-1, -2)) * scaling

    def zero_init(self, keys, values, own, module, query, key, value, attention_mask, **kwargs):
        """The family's attention over the tokens, plus ``tanh(g_h) softmax(q K_P^T s) V_P`` per head."""
        out, weights = own(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        probs = self.scores(query, keys, scaling).softmax(-1)
        prompted = torch.matmul(probs, expand_heads(values, query.shape[1]).float())  # [B, heads, S, d]
        prompted = self.gate.float().tanh()[:, None, None] * prompted
        return out + prompted.transpose(1, 2).to(out.dtype), weights

    def vanilla(self, keys, values, own, module, query, key, value, attention_mask, **kwargs):
        """One softmax over the prompts' and the tokens' scores (eager arithmetic, in float32)."""
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        heads = query.shape[1]
        tokens = self.scores(query, key, scaling)
        bias = token_bias(attention_mask, query.shape[2], key.shape[2], query.device)
        if bias is not None:
            tokens = tokens + bias
        probs = torch.cat([self.scores(query, keys, scaling), tokens], dim=-1).softmax(-1)
        n = keys.shape[2]
        out = torch.matmul(probs[..., :n], expand_heads(values, heads).float()) + \
            torch.matmul(probs[..., n:], expand_heads(value, heads).float())
        return out.transpose(1, 2).to(query.dtype), None

    def extra_repr(self) -> str:
        return f"prompts={self.num_prompts}, prompt={self.prompt}, attention={self.attention_kind}"
