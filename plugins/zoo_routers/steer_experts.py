"""Find experts tied to a behaviour (Mixture of Tunable Experts, fTRI): contrast how often each expert is
routed to on two sets of inputs, then switch those experts off or force them with the ``steer`` router."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from zoo.editing.calibration import batches
from zoo.evaluation.eval import UsageRecorder


@torch.no_grad()
def activation_rates(model, data, tokenizer=None, desc: str = "routing") -> dict[int, torch.Tensor]:
    """``{layer: [E]}``: the share of tokens routed to each expert (each token counts once per expert).

    ``data``: anything ``zoo.editing.calibration.batches`` accepts (texts, token batches, a corpus spec)."""
    model.eval()
    tokens = 0
    with UsageRecorder(model) as rec:
        for ids in tqdm(batches(data, tokenizer), desc=desc, leave=False):
            model(input_ids=ids.to(model.device))
            tokens += ids.numel()
    return {i: c.double() / max(tokens, 1) for (i, _), c in zip(rec.layers, rec.counts)}


def find_experts(model, texts_a, texts_b, tokenizer=None, top: int = 8) -> dict[int, list[int]]:
    """``{layer: [experts]}``: the ``top`` experts (over all layers, as in the paper) whose activation rate on
    ``texts_a`` most exceeds that on ``texts_b``. Only experts more active on ``texts_a`` are returned, and a
    layer keeps at least its top-k experts un-picked, so the result can be passed to ``steer`` as ``disable``."""
    rate_a = activation_rates(model, texts_a, tokenizer, "routing set a")
    rate_b = activation_rates(model, texts_b, tokenizer, "routing set b")
    k = {i: moe.top_k for i, moe in UsageRecorder(model).layers}
    room = {i: len(rate_a[i]) - k[i] for i in rate_a}
    ranked = sorted(((float(rate_a[i][e] - rate_b[i][e]), i, e) for i in rate_a for e in range(len(rate_a[i]))),
                    reverse=True)
    found: dict[int, list[int]] = {}
    for diff, i, e in ranked:
        if len([x for v in found.values() for x in v]) >= top or diff <= 0:
            break
        if len(found.get(i, [])) < room[i]:
            found.setdefault(i, []).append(e)
    return {i: sorted(found[i]) for i in sorted(found)}
