"""The model's output head on the last decoder layer's hidden states, for code that runs the layers itself
(``zoo.editing.stream.evaluate``): the final norm, the LM head, and what the family's forward does to the logits
after it (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Muse Spark's ``output_multiplier``, Gemma's, Beam's
and Muse Spark's final soft-cap; Inkling divides the normed hidden states by ``logits_mup_width_multiplier`` and drops
the head's padding rows).

A family whose forward does more between its last layer and its logits (hyper-connection streams merged at the end,
a head of its own) is refused with ``NoHead``: ``tests/families`` checks, for every converted family, that the head
here gives the family's own logits or that the family is refused."""
from __future__ import annotations

import torch

from zoo.moe.layout import family_and_base

NORMS = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f", "embedding_norm")  # LFM2's: at the end


class NoHead(ValueError):
    """The family's forward does more after its last decoder layer than a final norm and the LM head."""


# modules of a language model that act between its last decoder layer and its final norm (hyper-connection streams
# merged: DeepSeek-V4, Hunyuan-V4, GLM-5, Qwen4-exp; Inkling 2's final input mixing): the layers' output is not what
# the norm reads
TAILS = ("hc_head", "hyper_connection_mixer", "final_input")


def _text_model(model):
    fam, base = family_and_base(model)
    path = getattr(fam, "layers_path", None) or "layers"
    return base.get_submodule(path.rsplit(".", 1)[0]) if "." in path else base


def final_norm(model) -> torch.nn.Module:
    """The norm between the last decoder layer and the LM head (the language model's, in a vision-language model)."""
    text = _text_model(model)
    for name in NORMS:
        norm = getattr(text, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise NoHead(f"{type(model).__name__}: no final norm ({', '.join(NORMS)}) on {type(text).__name__}")


def output_head(model) -> torch.nn.Module:
    """The LM head: ``lm_head``, or where the model holds it below itself (Llama 4 multimodal's language model's)."""
    head = getattr(model, "lm_head", None)
    return head if head is not None else model.get_output_embeddings()


def check_head(model) -> None:
    """NoHead where ``head_logits`` cannot give this model's logits."""
    text = _text_model(model)
    tails = [name for name in TAILS if hasattr(text, name)]
    if tails:
        raise NoHead(f"{type(text).__name__} runs {tails[0]} between its last layer and its final norm, in its own "
                     "forward: a layer-by-layer evaluation cannot give its logits")
    final_norm(model)


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the model's forward computes from its last decoder layer's output ``hidden [B, S, H]``."""
    check_head(model)
    config = model.config.get_text_config()
    normed = final_norm(model)(hidden)
    inkling = hasattr(config, "logits_mup_width_multiplier")  # Inkling (v1)'s alone
    if inkling:  # muP's width multiplier divides what the head reads
        normed = normed / config.logits_mup_width_multiplier
    logits = output_head(model)(normed)
    if inkling and config.unpadded_vocab_size is not None:  # the head's rows past the checkpoint's vocabulary
        logits = logits[..., :config.unpadded_vocab_size]
    scaling = getattr(config, "logits_scaling", None)  # Granite: divided
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling != 1:
        logits = logits / scaling
    scale = getattr(model, "logit_scale", None)  # Cohere: multiplied (the model copies it from the config)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        logits = logits * scale
    multiplier = getattr(config, "output_multiplier", None)  # Muse Spark: multiplied, then soft-capped
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool) and getattr(
            config, "model_type", "") == "muse_spark_text":
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None) or getattr(model, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
        logits = torch.tanh(logits.float() / cap) * cap
    return logits
