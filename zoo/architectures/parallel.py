"""Tensor- and expert-parallel plans of the zoo's MoE block, for transformers' own distributed loading.

``from_pretrained(path, tp_plan="auto")`` or ``from_pretrained(path, distributed_config=DistributedConfig(...))``
shard a model by the plans its classes carry: ``base_model_tp_plan`` / ``base_model_ep_plan`` on the config class
(module paths under the base model, ``*`` for the layer number) and ``_tp_plan`` on the causal-LM class
(``lm_head``). A zoo config class inherits its family's plans, but the zoo block is not the native block:

* the router is ``mlp.router`` (native ``mlp.gate``), shared experts are ``mlp.shared_experts`` (Qwen2-MoE's
  ``mlp.shared_expert`` + ``mlp.shared_expert_gate``): ``tp_plan``/``ep_plan`` rename the native rules with the
  family's own weight renames, so a rule never names a module the zoo model lacks;
* the experts take ``(hidden, routing)``; transformers' hooks call ``(hidden_states, top_k_index,
  top_k_weights)``. Every ``zoo.Experts`` kind accepts both, and ``SparseMoE`` calls the second form when the
  hooks are installed (``_is_hooked``), so the hooks' all-reduces and token dispatch apply unchanged;
* experts are a choice per layer (quantized, factored, channel-top-k, ...), and a native style applied to a kind
  it does not fit gives wrong numbers silently (e.g. ``moe_tp_experts`` sums whole outputs of unsharded
  experts across ranks). The zoo styles below shard only kinds that say they fit
  (``Experts.supports_tensor_parallel`` / ``supports_expert_parallel``); the others stay whole on every rank
  (exact, not smaller), with a warning on rank 0. (A kind holding none of the EP plan's weights, e.g.
  quantized or factored, is still hooked by ``ep_dispatch_experts``, whose name transformers hard-codes; with
  all its experts on every rank the dispatch sends every token to rank 0's copy, which is exact too.)

Families of the generic adapter get their native plans rewritten (``generic_plan``): the blocks are where the
native plan shards experts, and there the zoo's own rules replace the native ones. The factory puts
``parallel_attributes(family)`` on each zoo config class. A model converted in memory
(``zoo.convert``) copied its native plans at init: ``init_parallel_plans()`` on the base model, then on the LM,
after the class swap, gives it the zoo's. Routers stay replicated (no native MoE plan of these families shards
its router; the ``ep_router`` style was removed in transformers 5.21). Shared experts are split like a dense
MLP, for Qwen2-MoE too (whose native plan leaves ``mlp.shared_expert`` whole).
"""
from __future__ import annotations

import logging

from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.utils.import_utils import is_torch_distributed_available

from zoo.moe.experts import Experts

logger = logging.getLogger(__name__)

MLP = "layers.*.mlp."  # where a family's MoE block sits, below the base model
EXPERTS = MLP + "experts"

# native experts styles -> the zoo's (same sharding, for the kinds that fit it)
ZOO_STYLES = {
    "packed_colwise": "zoo_experts_packed_colwise",
    "rowwise": "zoo_experts_rowwise",
    "moe_tp_experts": "zoo_experts_tp",
    "grouped_gemm": "zoo_experts_grouped_gemm",
}
SHARED_TP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


# ------------------------------------------------------------------------------------------------- plans

def tp_plan(family) -> dict[str, str]:
    """The zoo's ``base_model_tp_plan`` for ``family`` (a Family, its name, or its native or zoo config class)."""
    family = _family(family)
    plan = _zoo_plan(family, family.config_class.base_model_tp_plan, "tp")
    if plan and family.has_shared_experts:
        # SharedMLP is a SwiGLU MLP: split like the dense MLPs (DeepSeek-V3's native plan does the same); its
        # sigmoid gate (Qwen2-MoE, [1, H]) stays whole.
        for proj, style in SHARED_TP.items():
            plan.setdefault(f"{MLP}shared_experts.{proj}", style)
    return plan


def ep_plan(family) -> dict[str, str]:
    """The zoo's ``base_model_ep_plan`` for ``family``: whole experts per rank, tokens dispatched by
    transformers' ``ep_dispatch_experts`` (its EP implementations: all_reduce, all_to_all)."""
    family = _family(family)
    return _zoo_plan(family, family.config_class.base_model_ep_plan, "ep")


def parallel_attributes(family) -> dict:
    """Class attributes of the zoo config class of ``family``."""
    return {"base_model_tp_plan": tp_plan(family), "base_model_ep_plan": ep_plan(family)}


def _zoo_plan(family, native: dict | None, kind: str) -> dict[str, str]:
    if getattr(family, "generic", False):
        return generic_plan(native, kind) if getattr(family, "parallel_plans", True) else {}
    plan = {}
    for key, style in (native or {}).items():
        key = _zoo_key(key, family.renames)
        if key == EXPERTS or key.startswith(EXPERTS + "."):
            style = ZOO_STYLES.get(style, style)
        plan[key] = style
    return plan


# the zoo's rules for a block's experts: every kind stores [E, 2I, H] / [E, H, I] (or its own tensors, which the
# styles leave whole), whatever layout the native experts had (Llama 4's are transposed: packed_rowwise natively)
ZOO_EXPERT_RULES = {"tp": {"": "zoo_experts_tp", ".gate_up_proj": "zoo_experts_packed_colwise",
                           ".down_proj": "zoo_experts_rowwise"},
                    "ep": {"": "ep_dispatch_experts", ".gate_up_proj": "zoo_experts_grouped_gemm",
                           ".down_proj": "zoo_experts_grouped_gemm"}}
NATIVE_EXPERTS_STYLE = {"tp": "moe_tp_experts", "ep": "ep_dispatch_experts"}


def generic_plan(native: dict | None, kind: str) -> dict[str, str]:
    """A generic family's native ``kind`` ("tp" or "ep") plan in the zoo's module paths. The MoE blocks are where
    the native plan shards experts (``<prefix>.experts``, the block at ``<prefix>``; the zoo block sits at the same
    path): there the experts get the zoo's rules (``ZOO_EXPERT_RULES``) and a shared MLP the rules of the zoo's
    ``SharedMLP`` (``<prefix>.shared_experts``, split like a dense MLP) in place of the native ones; rules for other
    parts of a block (a router, a native-only module) are dropped, so their modules stay whole. Rules outside the
    blocks (attention, embeddings, the dense MLPs of dense layers, ``<prefix>.gate_proj``) are kept as they are:
    the zoo model keeps those modules."""
    native = native or {}
    prefixes = {k[:-len(".experts")] for k, style in native.items()
                if k.endswith(".experts") and style == NATIVE_EXPERTS_STYLE[kind]}
    plan, shared = {}, set()
    for key, style in native.items():
        prefix = next((p for p in prefixes if key.startswith(p + ".")), None)
        rest = key[len(prefix) + 1:].split(".") if prefix else None
        if prefix is None or (len(rest) == 1 and rest[0] != "experts"):  # outside a block, or a dense layer's MLP
            plan[key] = style
        elif rest[0] != "experts" and len(rest) == 2 and rest[1] in SHARED_TP:  # the block's shared MLP
            shared.add(prefix)
    for prefix in sorted(prefixes):
        # the rules for the tensors the native experts have (ungated experts, Nemotron-H's, hold no gate_up_proj:
        # the zoo's ``mlp`` kind has no parallel form and stays whole)
        plan.update({f"{prefix}.experts{suffix}": style for suffix, style in ZOO_EXPERT_RULES[kind].items()
                     if not suffix or f"{prefix}.experts{suffix}" in native})
        if kind == "tp" and prefix in shared:
            plan.update({f"{prefix}.shared_experts.{proj}": style for proj, style in SHARED_TP.items()})
    return plan


def install_language_model_plans(model, base, family) -> None:
    """A vision-language model of a generic family: its language model carries the plans of its own (text) config
    class, which name the native blocks and apply native experts styles to whatever experts kind the zoo block
    holds; they become the zoo's (``generic_plan``, or none where the family has ``parallel_plans = False``), and
    the model's plans are gathered again."""
    path = family.layers_path or ""
    if not getattr(family, "generic", False) or "." not in path:
        return
    lm = base.get_submodule(path.rsplit(".", 1)[0])
    native = type(lm.config)
    on = getattr(family, "parallel_plans", True)
    lm._tp_plan = generic_plan(native.base_model_tp_plan, "tp") if on else {}
    lm._ep_plan = generic_plan(native.base_model_ep_plan, "ep") if on else {}
    base.init_parallel_plans()
    if model is not base:
        model.init_parallel_plans()


def _zoo_key(key: str, renames: dict[str, str]) -> str:
    """A native rule's path in the zoo block: the family's renames inside ``mlp.`` (``gate`` -> ``router``)."""
    if not key.startswith(MLP):
        return key
    rest = key[len(MLP):] + "."
    for old, new in renames.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return MLP + rest[:-1]


def _family(family):
    if hasattr(family, "renames") and hasattr(family, "config_class"):
        return family
    from zoo.components.registry import registry

    families = [r.obj for r in registry.all("architecture")]
    if isinstance(family, str):
        for fam in families:
            if family in (fam.name, f"zoo_{fam.name}"):
                return fam
    elif isinstance(family, type):
        zoo_family = getattr(family, "zoo_family", None)
        if zoo_family is not None:
            return zoo_family
        for fam in families:  # most derived first: a zoo config class subclasses its native one
            if issubclass(family, fam.config_class) or getattr(family, "model_type", None) == f"zoo_{fam.name}":
                return fam
    raise KeyError(f"no registered MoE family for {family!r}")


# ------------------------------------------------------------------------------------------------ styles

_warned: set[tuple[str, str]] = set()


def _fits(module, kind: str) -> bool:
    """Whether the ``kind`` ("tensor" or "expert") parallel style may shard ``module``; warns once per kind if not."""
    ok = isinstance(module, Experts) and (
        module.supports_tensor_parallel() if kind == "tensor" else module.supports_expert_parallel())
    if not ok:
        name = getattr(module, "name", "") or type(module).__name__
        if (kind, name) not in _warned:
            _warned.add((kind, name))
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.warning("%s experts (%s) have no %s-parallel form: they stay whole on every rank.",
                               name, type(module).__name__, kind)
    return ok


if is_torch_distributed_available():
    from torch.distributed.tensor import Shard
    from transformers.distributed.expert_parallel import MoEParamShard
    from transformers.distributed.tensor_parallel import (
        MoeExpertsParallel,
        PackedColwiseParallel,
        RowwiseParallel,
    )

    class ExpertsPackedColwise(PackedColwiseParallel):
        """``gate_up_proj [E, 2I, H]``: each rank holds its slice of the gate rows and the same slice of the up
        rows (transformers' ``packed_colwise``), for the kinds that fit."""

        def shard_param(self, module, param, mesh):
            if _fits(module, "tensor"):
                super().shard_param(module, param, mesh)

    class ExpertsRowwise(RowwiseParallel):
        """``down_proj [E, H, I]``: each rank holds its slice of the intermediate channels (``rowwise``)."""

        def shard_param(self, module, param, mesh):
            if _fits(module, "tensor"):
                super().shard_param(module, param, mesh)

    class ExpertsTensorParallel(MoeExpertsParallel):
        """``moe_tp_experts`` (local weights, partial outputs summed across ranks, routing-weight gradients
        summed in backward) for the kinds that fit; the others keep their own forward, whole on every rank."""

        def install_forward(self, module, mesh):
            if not _fits(module, "tensor"):
                return module
            return super().install_forward(module, mesh)

    class ExpertsGroupedGemm(MoEParamShard):
        """``grouped_gemm``: whole experts per rank (dim 0 split, ``num_experts`` narrowed to this rank's), for the
        kinds whose every tensor is per expert. The others keep all experts on every rank: the EP dispatch then
        sends every token to rank 0's experts (all of them), which is exact."""

        def __init__(self):
            super().__init__(Shard(0), shards_expert_dim=True)

        def shard_param(self, module, param, mesh):
            if _fits(module, "expert"):
                super().shard_param(module, param, mesh)

    ALL_PARALLEL_STYLES.register("zoo_experts_packed_colwise", ExpertsPackedColwise())
    ALL_PARALLEL_STYLES.register("zoo_experts_rowwise", ExpertsRowwise())
    ALL_PARALLEL_STYLES.register("zoo_experts_tp", ExpertsTensorParallel())
    ALL_PARALLEL_STYLES.register("zoo_experts_grouped_gemm", ExpertsGroupedGemm())
