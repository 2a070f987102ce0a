"""Train a ``zoo_mm`` model on the multimodal digits (AdamW, warm-up then cosine, balance loss on).

Each batch mixes image-only, audio-only and both examples; half the clips carry white noise at a random
SNR, so the model learns to lean on the image when the audio is poor (the MoHAVE setting). With ``group_bias``
(default 0.1) each decoder layer's group gate is bound to the modality its group serves and trained with MoHAVE's
group-load biasing loss besides the language-model and balance losses.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
from zoo_multimodal.dataset import MODES, batch, load_split
from zoo_multimodal.hierarchical_modality import bind_groups, group_load_loss
from zoo_multimodal.modeling_zoo_mm import ZooMMForCausalLM
from zoo_multimodal.processing_zoo_mm import ZooMMProcessor

TRAIN_SNRS = (20, 10, 5, 0, -5)


def train(steps: int = 1500, batch_size: int = 48, lr: float = 3e-3, seed: int = 0, split=None, processor=None,
          log_every: int = 100, group_bias: float = 0.1, **config):
    """Returns (model, processor, history); ``config`` overrides ``ZooMMConfig`` fields. ``group_bias`` weighs
    MoHAVE's group-load biasing loss (each hierarchical-modality router bound to its experts' modality groups;
    0: unbound, the routers learn groups from the language-model and balance losses alone)."""
    if isinstance(group_bias, bool) or not isinstance(group_bias, (int, float)) or not 0 <= group_bias < math.inf:
        raise ValueError(f"group_bias must be a finite number >= 0, got {group_bias!r}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    processor = processor or ZooMMProcessor()
    split = split or load_split(processor, "train", snrs=TRAIN_SNRS)
    model = ZooMMForCausalLM(ZooMMConfig(vocab_size=len(processor.tokenizer), output_router_logits=True, **config))
    routers = bind_groups(model) if group_bias > 0 else []
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    snr_choices = [None, *[s for s in split.audio if s is not None]]
    history = []
    for step in tqdm(range(steps), desc="zoo_mm: training"):
        digits = rng.integers(10, size=batch_size)
        modes = [MODES[i] for i in rng.integers(3, size=batch_size)]
        noisy = rng.random(batch_size) < 0.5
        snr = [snr_choices[rng.integers(1, len(snr_choices))] if n and len(snr_choices) > 1 else None for n in noisy]
        inputs = batch(processor, split, digits, modes, snr=snr, rng=rng)
        out = model(**inputs)
        loss = out.loss
        biasing = group_load_loss(routers)
        if biasing is not None:
            loss = loss + group_bias * biasing
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(out.loss.item())
        if log_every and (step + 1) % log_every == 0:
            tqdm.write(f"step {step + 1}: loss {np.mean(history[-log_every:]):.4f} aux {float(out.aux_loss):.3f}")
    model.config.output_router_logits = False
    model.eval()
    return model, processor, history
