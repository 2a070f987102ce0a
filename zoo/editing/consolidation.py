"""``zoo.consolidate([m1, m2, ...])``: several fine-tunes of one MoE share the experts that stayed similar.

Imani et al., "QoS-Efficient Serving of Multiple Mixture-of-Expert LLMs Using Partial Runtime Reconfiguration"
(ICML 2025, arXiv:2505.06481): to serve many fine-tuned copies of one MoE on one device, experts that stayed
similar across the copies (or to the base model) are kept once and shared (similarity-based expert
consolidation); the dissimilar experts and every non-expert layer (attention, norms, embeddings, routers, shared
experts) stay per model and are switched in for a request of that model (partial runtime reconfiguration: here,
each model object keeps its own, and serving model i is running model i).

Per MoE layer and expert index e (fine-tunes keep the base's expert order, so expert e of every copy descends from
the same base expert), the similarity of two copies is the cosine similarity of their flattened weights (all of
the expert's tensors, concatenated); bit-identical experts have similarity exactly 1. With ``base``: every model
whose expert e has similarity >= ``threshold`` to the base's expert e is served by the base's copy (when at least
two are: one model alone saves nothing). Without: greedy groups in model order, each led by the first model not
yet grouped and joined by every later one whose expert is >= ``threshold`` similar to the leader's; the group is
served by the leader's copy (``share="mean"``: by the mean of the group's copies, a variant of ours). The exact
measure and threshold rule are our reading of the paper (its abstract names the mechanism, not these details).

The models are consolidated in place and returned: per layer one pool of the distinct experts, shared by every
model (``zoo.moe.pooled``), so the saved bytes are real in this process. Saved, each model is an ordinary zoo
checkpoint with its own experts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from zoo.components.options import check_float, check_int, suggest

PAPER = ("Imani et al., QoS-Efficient Serving of Multiple Mixture-of-Expert LLMs Using Partial Runtime "
         "Reconfiguration, ICML 2025, arXiv:2505.06481")
SHARE = ("anchor", "mean")
KINDS = ("swiglu", "mlp")  # dense fused experts (exactly these classes): every stored tensor is per expert


@dataclass
class Consolidation:
    """What ``consolidate`` did. ``groups[j]``: per consolidated layer, per expert index, the groups of model
    indices served by one copy. Bytes count every tensor of all the models once per storage."""

    models: list
    threshold: float
    bytes_before: int
    bytes_after: int
    groups: list = field(default_factory=list)  # [{"layer": i, "experts": [[[0, 1], [2]], ...]}]
    similarity: list = field(default_factory=list)  # [{"layer": i, "experts": [M x M matrix per expert]}]
    perplexity: dict | None = None  # {"domains": [...], "before": [...], "after": [...]}

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def shared_experts(self) -> int:
        """(model, expert) pairs served by a copy another model also uses."""
        return sum(len(g) for layer in self.groups for e in layer["experts"] for g in e if len(g) > 1)

    def table(self) -> str:
        lines = [f"threshold {self.threshold}: {self.shared_experts} (model, expert) pairs share a copy; "
                 f"{self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB "
                 f"({self.bytes_saved / 2**20:.2f} MiB saved, {100 * self.bytes_saved / self.bytes_before:.1f}%)"]
        if self.perplexity:
            lines.append(f"{'model':8}{'domain':10}{'before':>10}{'after':>10}{'change':>10}")
            for i, (d, b, a) in enumerate(zip(self.perplexity["domains"], self.perplexity["before"],
                                              self.perplexity["after"])):
                lines.append(f"{i:<8}{d:10}{b:10.3f}{a:10.3f}{100 * (a / b - 1):+9.2f}%")
        return "\n".join(lines)


def consolidate(models, threshold: float = 0.99, base=None, share: str = "anchor", domains=None,
                seq_len: int = 128, windows: int = 8, progress: bool = True) -> Consolidation:
    """Share the similar experts of ``models`` (fine-tunes of one zoo MoE) in place; see the module doc.
    ``domains``: one domain per model (``"english"``/``"code"``) to measure each model's held-out perplexity on
    its own domain before and after (``windows`` windows of ``seq_len`` tokens)."""
    from zoo.moe.pooled import PooledExperts
    from zoo.moe.layout import moe_layers

    models = _check(models, threshold, base, share, domains, seq_len, windows)
    tokenizers = None
    if domains is not None:
        from zoo.io.loading import tokenizer_for
        tokenizers = [tokenizer_for(m, required=True) for m in models]
    before = unique_bytes(models)
    ppl_before = ([held_out_perplexity(m, t, d, seq_len, windows) for m, t, d in zip(models, tokenizers, domains)]
                  if domains is not None else None)
    layers = [moe_layers(m) for m in models]
    base_layers = moe_layers(base) if base is not None else None
    groups, similarity = [], []
    for j in tqdm(range(len(layers[0])), desc="consolidate experts", disable=not progress):
        index = layers[0][j][0]
        blocks = [layer[j][1] for layer in layers]
        base_experts = base_layers[j][1].experts if base is not None else None
        pool, slots, layer_groups, sims = _consolidate_layer([b.experts for b in blocks], base_experts, threshold,
                                                             share)
        for block, own in zip(blocks, slots):
            block.experts = PooledExperts(pool, own)  # the old fused tensors go with the old module
        groups.append({"layer": index, "experts": layer_groups})
        similarity.append({"layer": index, "experts": sims})
    after = unique_bytes(models)
    ppl = None
    if domains is not None:
        ppl_after = [held_out_perplexity(m, t, d, seq_len, windows) for m, t, d in zip(models, tokenizers, domains)]
        ppl = {"domains": list(domains), "before": ppl_before, "after": ppl_after}
    return Consolidation(models, float(threshold), before, after, groups, similarity, ppl)


def _check(models, threshold, base, share, domains, seq_len, windows) -> list:
    """Every argument checked before any model is touched; one line says what is wrong."""
    from zoo.data.corpus import DOMAINS
    from zoo.moe.layout import moe_layers
    from zoo.moe.experts import MLPExperts, SwiGLUExperts
    from zoo.moe.pooled import PooledExperts

    if not isinstance(models, (list, tuple)) or len(models) < 2:
        raise ValueError("consolidate needs a list of at least two models (fine-tunes of one MoE)")
    models = list(models)
    if len({id(m) for m in models}) != len(models):
        raise ValueError("consolidate got the same model object twice; pass each fine-tune once")
    check_float("threshold", threshold, -1.0, 1.0)
    if share not in SHARE:
        raise ValueError(f"share must be one of {SHARE}, got {share!r}{suggest(str(share), SHARE)}")
    if share == "mean" and base is not None:
        raise ValueError("share='mean' groups the models among themselves; with a base, the base's copy is shared")
    check_int("seq_len", seq_len, 2)
    check_int("windows", windows, 1)
    if domains is not None:
        if not isinstance(domains, (list, tuple)) or len(domains) != len(models):
            raise ValueError(f"domains must give one domain per model ({len(models)}), got {domains!r}")
        for d in domains:
            if d not in DOMAINS:
                raise ValueError(f"domains: {d!r} is not one of {DOMAINS}{suggest(str(d), DOMAINS)}")
    candidates = models + ([base] if base is not None else [])
    if base is not None and any(base is m for m in models):
        raise ValueError("base is also one of the models; pass it only as base")
    names = [f"models[{i}]" for i in range(len(models))] + (["base"] if base is not None else [])
    for name, m in zip(names, candidates):
        if not isinstance(m, torch.nn.Module) or not hasattr(m, "config"):
            raise ValueError(f"{name} is not a model (got {type(m).__name__})")
        layers = moe_layers(m) if _has_layers(m) else []
        if not layers:
            raise ValueError(f"{name} has no zoo MoE layers (zoo.convert it first; merge a PEFT adapter first)")
        for i, moe in layers:
            kind = moe.experts.name
            if isinstance(moe.experts, PooledExperts):
                raise ValueError(f"{name} is consolidated already (layer {i}); zoo.editing.consolidation.unshare it first")
            if type(moe.experts) not in (SwiGLUExperts, MLPExperts):
                raise ValueError(f"{name} layer {i} has {kind!r} experts; consolidate shares dense experts "
                                 f"({', '.join(KINDS)})")
    ref_layout, ref_shapes = _fingerprint(models[0])
    for name, m in list(zip(names, candidates))[1:]:
        layout, shapes = _fingerprint(m)
        if type(m) is not type(models[0]):
            raise ValueError(f"{name} is a {type(m).__name__}, models[0] a {type(models[0]).__name__}: "
                             "consolidate needs fine-tunes of one architecture")
        if layout != ref_layout:
            diff = next(i for i, (a, b) in enumerate(zip(layout, ref_layout)) if a != b) if len(layout) == len(
                ref_layout) else None
            where = f"layer {diff}'s MoE block" if diff is not None else "the number of layers"
            raise ValueError(f"{name} differs from models[0] in {where}: consolidate needs fine-tunes of one "
                             "architecture")
        if shapes != ref_shapes:
            key = next((k for k in ref_shapes if shapes.get(k) != ref_shapes[k]), None) or next(
                k for k in shapes if k not in ref_shapes)
            raise ValueError(f"{name} differs from models[0] at {key} ({shapes.get(key)} vs {ref_shapes.get(key)}): "
                             "consolidate needs fine-tunes of one architecture")
    return models


def _has_layers(model) -> bool:
    from zoo.moe.layout import block_attr
    try:
        block_attr(model)
    except Exception:  # not a model the zoo knows the decoder layers of
        return False
    return True


def _fingerprint(model):
    from zoo.moe.layout import read_layout
    layout = json.loads(json.dumps(read_layout(model)))
    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()}
    return layout, shapes


def expert_vectors(experts) -> torch.Tensor:
    """``[E, n]``: each expert's tensors flattened and concatenated (float32)."""
    return torch.cat([t.detach().float().reshape(experts.num_experts, -1) for _, t in
                      sorted(experts.state_dict().items())], dim=1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two flattened experts; exactly 1 for bit-identical ones."""
    if torch.equal(a, b):
        return 1.0
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@torch.no_grad()
def _consolidate_layer(experts: list, base, threshold: float, share: str):
    """One layer: the pool (a new dense experts module holding each group's copy once), each model's slots, the
    groups per expert index, and the similarity matrices (models, then the base when given)."""
    vectors = [expert_vectors(x) for x in experts]
    base_vec = expert_vectors(base) if base is not None else None
    states = [x.state_dict() for x in experts]
    base_state = base.state_dict() if base is not None else None
    num = experts[0].num_experts
    rows = {k: [] for k in states[0]}
    slots = [[0] * num for _ in experts]
    layer_groups, sims = [], []
    for e in range(num):
        vecs = [v[e] for v in vectors] + ([base_vec[e]] if base is not None else [])
        sim = [[cosine(a, b) for b in vecs] for a in vecs]
        sims.append([[round(s, 6) for s in row] for row in sim])  # reported rounded, compared exact
        groups = _groups(sim, len(experts), base is not None, threshold)
        for members, source in groups:
            for m in members:
                slots[m][e] = len(rows[next(iter(rows))])
            for k in rows:
                if source == "base":
                    row = base_state[k][e]
                elif share == "mean" and len(members) > 1:
                    row = torch.stack([states[m][k][e].float() for m in members]).mean(0).to(states[0][k].dtype)
                else:
                    row = states[source][k][e]
                rows[k].append(row)
        layer_groups.append([members for members, _ in groups])
    opts = {**experts[0].options(), "num_experts": len(rows[next(iter(rows))])}
    with torch.device("meta"):
        pool = type(experts[0])(**opts)
    pool.load_state_dict({k: torch.stack(v).contiguous() for k, v in rows.items()}, assign=True)
    pool.train(experts[0].training)
    return pool, slots, layer_groups, sims


def _groups(sim, models: int, with_base: bool, threshold: float) -> list[tuple[list[int], object]]:
    """(members, source) per copy kept: source a model index, or "base"."""
    if with_base:
        near = [m for m in range(models) if sim[m][models] >= threshold]
        if len(near) >= 2:
            return [(near, "base")] + [([m], m) for m in range(models) if m not in near]
        return [([m], m) for m in range(models)]
    groups, left = [], list(range(models))
    while left:
        lead = left.pop(0)
        members = [lead] + [m for m in left if sim[lead][m] >= threshold]
        left = [m for m in left if m not in members]
        groups.append((members, lead))
    return groups


def unique_bytes(models) -> int:
    """Bytes of every parameter and buffer of ``models``, each storage once (shared tensors count once)."""
    seen, total = set(), 0
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@torch.no_grad()
def held_out_perplexity(model, tokenizer, domain: str, seq_len: int, windows: int, batch: int = 8) -> float:
    """Perplexity on the first ``windows`` windows of ``domain``'s held-out split (``zoo.evaluation.eval``'s windows)."""
    from zoo.data.tokens import eval_windows, token_stream

    ids_all = eval_windows(token_stream(domain, "val", tokenizer), seq_len, windows)
    was_training = model.training
    model.eval()
    total = count = 0.0
    for i in range(0, len(ids_all), batch):
        ids = ids_all[i:i + batch]
        loss = model(input_ids=ids, labels=ids).loss.float().item()
        n = ids.numel() - ids.shape[0]
        total, count = total + loss * n, count + n
    model.train(was_training)
    return round(math.exp(total / count), 4)


def unshare(model):
    """Give a consolidated model its own copies of its experts (plain dense modules again), in place; needed
    before pruning, merging or quantizing it. Returns the model."""
    from zoo.moe.layout import moe_layers
    from zoo.moe.pooled import PooledExperts, own_experts

    for _, moe in moe_layers(model):
        if isinstance(moe.experts, PooledExperts):
            moe.experts = own_experts(moe.experts)
    return model
