"""Tensor and expert parallelism of zoo models through transformers' own machinery (zoo.architectures.parallel).

Static part: every rule of the zoo plans names a module or parameter of the zoo model (none of the native block's
paths), the styles are registered, the expanded plans cover every MoE layer, and the adapters (the experts'
second call form, the block's call under the hooks) change no number.

Distributed part: one ``torchrun --nproc-per-node 2`` on CPU/gloo runs tests/parallel_worker.py over tiny native
models and their zoo conversions saved to folders, sharded with ``tp_plan="auto"`` and with
``DistributedConfig(ep_size=2, ...)``, and compares logits (fp32, 1e-5) and gradients with the folder loaded whole.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import zoo
from tiny import FAMILIES, tiny_native
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from zoo.architectures import parallel
from zoo.architectures.factory import _CLASSES, zoo_classes
from zoo.moe.layout import moe_layers
from zoo.moe import Routing, SparseMoE, SwiGLUExperts
from zoo.moe.channel_topk import ChannelTopKExperts
from zoo.moe.factored import FactoredExperts
from zoo.moe.quantized import QuantizedExperts
from zoo_routers.topk_softmax import TopKSoftmax

WORKER = os.path.join(os.path.dirname(__file__), "parallel_worker.py")


@pytest.fixture
def zoo_plans(monkeypatch):
    """The zoo plans on the zoo config classes, as the factory is to set them (a no-op once it does)."""
    for cfg_cls, _, lm_cls in list(_CLASSES.values()):
        for attr, value in parallel.parallel_attributes(lm_cls.zoo_family).items():
            monkeypatch.setattr(cfg_cls, attr, value)


def family(name):
    from zoo.components.registry import registry

    return registry.get("architecture", name).obj


def zoo_model(name, folder):
    """A zoo model as distributed loading builds it: from a saved folder, by its class (so its instance plans
    come from the zoo config class, not from the native model it was converted from)."""
    zoo.convert(tiny_native(name)).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def names(module) -> set[str]:
    return {replace_layer_number_by_wildcard(n) for n, _ in [*module.named_modules(), *module.named_parameters()]}


# ------------------------------------------------------------------------------------------------ plans

@pytest.mark.parametrize("name", FAMILIES)
def test_plans_name_only_zoo_modules(name, zoo_plans, tmp_path):
    model = zoo_model(name, tmp_path)
    native = tiny_native(name)
    zoo_names, native_names = names(model.model), names(native.model)
    for native_plan, plan in ((family(name).config_class.base_model_tp_plan or {}, parallel.tp_plan(name)),
                              (family(name).config_class.base_model_ep_plan or {}, parallel.ep_plan(name))):
        assert set(plan.values()) <= set(ALL_PARALLEL_STYLES), plan
        # every rule names a zoo module or parameter; the only exceptions are native rules for what this config
        # does not build either (e.g. the dense MLP of mlp_only_layers when there is none)
        missing = [k for k in plan if k not in zoo_names and (k in native_names or k not in native_plan)]
        assert not missing, f"{name}: rules naming nothing in the zoo model: {missing}"
        # no native-only path (mlp.gate, mlp.shared_expert, ...) survives
        native_only = {k for k in native_names if k not in zoo_names}
        assert not native_only & set(plan)
        # and every native rule that shards something of the native model has its zoo counterpart
        for key in native_plan:
            if key in native_names:
                assert parallel._zoo_key(key, family(name).renames) in plan
    # the plans reach the instance (base model rules under "model.", the LM's lm_head rule)
    assert {f"model.{k}": v for k, v in parallel.tp_plan(name).items()}.items() <= model.tp_plan.items()
    assert {f"model.{k}": v for k, v in parallel.ep_plan(name).items()}.items() <= model.ep_plan.items()


@pytest.mark.parametrize("name", FAMILIES)
def test_expanded_plans_cover_every_moe_layer(name, zoo_plans, tmp_path):
    model = zoo_model(name, tmp_path)
    tp, ep, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
    tp_only, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    shards_experts_tp = "layers.*.mlp.experts" in parallel.tp_plan(name)
    for i, moe in moe_layers(model):
        path = f"model.layers.{i}.mlp.experts"
        assert ep[path] == "ep_dispatch_experts"
        assert ep[f"{path}.gate_up_proj"] == ep[f"{path}.down_proj"] == "zoo_experts_grouped_gemm"
        assert not any(k.startswith(path) for k in tp)  # EP rules take precedence over TP ones
        if shards_experts_tp:
            assert tp_only[path] == "zoo_experts_tp"
            assert tp_only[f"{path}.gate_up_proj"] == "zoo_experts_packed_colwise"
            assert tp_only[f"{path}.down_proj"] == "zoo_experts_rowwise"
        if moe.shared_experts is not None and tp_only:
            assert tp_only[f"model.layers.{i}.mlp.shared_experts.down_proj.weight"] == "rowwise"
            assert f"model.layers.{i}.mlp.shared_experts.gate.weight" not in tp_only  # Qwen2-MoE's gate: whole


@pytest.mark.parametrize("name", ["granitemoeshared", "glm4_moe", "qwen3_next", "llama4_text", "nemotron_h",
                                  "longcat_flash", "qwen3_vl_moe", "gemma4_text"])
def test_generic_families_get_the_zoo_rules_for_their_blocks(name):
    """A generic family's plans, as its converted model resolves them: each MoE layer's experts under the zoo's
    styles (never a native style on a zoo experts module), shared experts split as the zoo's SharedMLP, every rule
    naming a module or parameter the zoo model has, no rule left for a native-only part of the block. Gemma 4 (its
    experts in the decoder layer natively) has none: every module stays whole."""
    from tests.families.test_generic_families import native_model

    model = zoo.convert(native_model(name))
    fam = type(model).zoo_family
    moe = moe_layers(model)
    prefix = {i: f"{'model.' + fam.layers_path}.{i}.{fam.block_attr}" for i, _ in moe}
    if not getattr(fam, "parallel_plans", True):
        assert not [k for k in (*model.tp_plan, *model.ep_plan) if ".layers." in k]  # the LM head's rule at most
        return
    tp, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    zoo_names = {n for n, _ in [*model.named_modules(), *model.named_parameters()]}
    assert set(tp) <= zoo_names, sorted(set(tp) - zoo_names)
    for i, block in moe:
        experts = f"{prefix[i]}.experts"
        assert tp[experts] == "zoo_experts_tp" and tp[f"{experts}.down_proj"] == "zoo_experts_rowwise"
        assert not any(k.startswith(prefix[i] + ".") and not k.startswith((experts, f"{prefix[i]}.shared_experts"))
                       for k in tp)  # nothing for the router or a native-only part
        if block.shared_experts is not None and f"{prefix[i]}.shared_experts.down_proj" in \
                {k.rsplit(".weight", 1)[0] for k in tp}:
            assert tp[f"{prefix[i]}.shared_experts.down_proj.weight"] == "rowwise"
    if fam.config_class.base_model_ep_plan or getattr(fam.text_config(model.config), "base_model_ep_plan", None):
        _, ep, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
        for i, _ in moe:
            assert ep[f"{prefix[i]}.experts"] == "ep_dispatch_experts"
            assert ep[f"{prefix[i]}.experts.down_proj"] == "zoo_experts_grouped_gemm"


def test_plan_of_config_classes_and_names():
    from transformers import Qwen2MoeConfig

    cfg_cls = zoo_classes(family("qwen2_moe"))[0]
    assert parallel.tp_plan(Qwen2MoeConfig) == parallel.tp_plan(cfg_cls) == parallel.tp_plan("zoo_qwen2_moe")
    plan = parallel.tp_plan("qwen2_moe")
    assert plan["layers.*.mlp.shared_experts.gate_proj"] == "colwise"
    assert "layers.*.mlp.gate_proj" in plan  # the dense MLP of mlp_only_layers: not renamed to the router
    assert parallel._zoo_key("layers.*.mlp.gate", family("qwen2_moe").renames) == "layers.*.mlp.router"
    assert parallel._zoo_key("layers.*.mlp.shared_expert_gate", family("qwen2_moe").renames) == \
        "layers.*.mlp.shared_experts.gate"
    assert parallel.tp_plan("gpt_oss") == {"embed_tokens": "embedding_rowwise"}  # experts with biases: EP only
    with pytest.raises(KeyError):
        parallel.tp_plan("no_such_family")


def test_factory_sets_the_plans():
    """The contract with zoo/architectures/factory.py: the zoo config classes carry the zoo plans."""
    missing = [cfg.__name__ for cfg, _, lm in _CLASSES.values()
               if cfg.__dict__.get("base_model_tp_plan") != parallel.tp_plan(lm.zoo_family)
               or cfg.__dict__.get("base_model_ep_plan") != parallel.ep_plan(lm.zoo_family)]
    assert not missing, f"the factory does not set parallel.parallel_attributes(family) on {missing}"


# --------------------------------------------------------------------------------------------- adapters

def kinds():
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 32)
    factored = FactoredExperts(4, 64, 32, rank_gate_up=8, rank_down=8, num_u=2)
    with torch.no_grad():
        for p in factored.parameters():
            p.normal_(0, 0.1)
    return {"swiglu": dense, "channel-topk": ChannelTopKExperts.from_dense(dense, budget=0.5),
            "factored": factored, "quantized": QuantizedExperts.from_dense(dense, bits=8, group_size=32),
            "swiglu-bias": SwiGLUExperts(4, 64, 32, activation="clamped-swiglu", bias=True)}


@pytest.mark.parametrize("kind", ["swiglu", "channel-topk", "factored", "quantized", "swiglu-bias"])
def test_experts_take_transformers_call(kind):
    experts = kinds()[kind]
    x = torch.randn(7, 64)
    indices = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 4], [4, 4], [2, 1]])  # 4 = empty slot
    weights = torch.rand(7, 2)
    with torch.no_grad():
        want = experts(x, Routing(weights, indices))
        assert torch.equal(experts(x, indices, weights), want)
        assert torch.equal(experts.forward(x, indices, weights), want)


def test_what_each_kind_supports():
    k = kinds()
    assert {n: e.supports_tensor_parallel() for n, e in k.items()} == {
        "swiglu": True, "channel-topk": False, "factored": False, "quantized": False, "swiglu-bias": False}
    assert {n: e.supports_expert_parallel() for n, e in k.items()} == {
        "swiglu": True, "channel-topk": True, "factored": False, "quantized": False, "swiglu-bias": True}


def test_block_under_hooks_gives_the_same_numbers():
    torch.manual_seed(0)
    experts = SwiGLUExperts(4, 64, 32)
    block = SparseMoE(TopKSoftmax(64, 4, 2), experts)
    hidden = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = block(hidden)
        experts._is_hooked = True  # as transformers' apply_tensor/expert_parallelism mark it
        calls = []
        handle = experts.register_forward_pre_hook(lambda m, args: calls.append(len(args)))
        got = block(hidden)
        handle.remove()
    assert calls == [3] and torch.equal(got, want)
    # empty slots (id E, any weight) become expert 0 with weight 0: what an EP dispatch can index
    x = torch.randn(3, 64)
    routing = Routing(torch.tensor([[0.5, float("nan")], [1.0, 0.2], [0.3, 0.7]]),
                      torch.tensor([[1, 4], [4, 4], [2, 0]]))
    with torch.no_grad():
        assert torch.allclose(block._parallel_experts(x, routing), experts._forward_sorted(x, routing), atol=1e-6)


def test_layout_keeps_the_global_expert_count():
    block = SparseMoE(TopKSoftmax(64, 4, 2), SwiGLUExperts(4, 64, 32))
    block.experts.num_experts = 2  # what transformers' grouped_gemm leaves on a rank of 2
    assert block.num_experts == 4
    assert block.layout()["num_experts"] == block.layout()["experts_options"]["num_experts"] == 4


# ------------------------------------------------------------------------------------------- torchrun

DIST_FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]
# families of the generic adapter, their plans derived from the native ones (block at block_sparse_moe with a
# shared MLP; a dense first layer, shared experts, grouped routing), in the modes that exercise each rule kind
GENERIC_FAMILIES = ["granitemoeshared", "glm4_moe"]
GENERIC_MODES = ["tp", "tp+ep", "tp_backward"]
MODELS = [f"{f}_{k}" for f in DIST_FAMILIES for k in ("native", "zoo")] + ["mixed_zoo"]
GENERIC_MODELS = [f"{f}_zoo" for f in GENERIC_FAMILIES]  # (their native plans are transformers' own to test)
MODES = ["tp", "tp+ep", "tp+ep_all_to_all", "fsdp+ep", "tp_backward", "tp+ep_backward", "tp+ep_save"]


def _distributed_unavailable() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend (CPU collectives) in this build"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun over every (model, mode): {(model, mode): record}."""
    reason = _distributed_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("parallel")
    specs = []
    for name in DIST_FAMILIES:
        tiny_native(name).save_pretrained(root / f"{name}_native")
        zoo.convert(tiny_native(name)).save_pretrained(root / f"{name}_zoo")
    mixed = zoo.convert(tiny_native("mixtral"))  # per-layer kinds: one without TP/EP form, one with EP only
    (_, first), (_, second) = moe_layers(mixed)
    first.experts = QuantizedExperts.from_dense(first.experts, bits=8, group_size=32)
    second.experts = ChannelTopKExperts.from_dense(second.experts, budget=0.5)
    mixed.save_pretrained(root / "mixed_zoo")
    for name in GENERIC_FAMILIES:
        zoo.convert(generic_native(name)).save_pretrained(root / f"{name}_zoo")
    specs = [f"{m}={root / m}" for m in MODELS] + [f"{m}={root / m},{','.join(GENERIC_MODES)}" for m in GENERIC_MODELS]
    out = root / "results.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
           str(out), *specs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out: {(e.stderr or '')[-3000:]}")
    if not out.exists():
        pytest.fail(f"torchrun failed (rc {proc.returncode}) before writing results:\n{proc.stderr[-6000:]}")
    if proc.returncode != 0:
        # rank 0 writes the results only after every case ran on both ranks (each diff is all-reduced):
        # a failure after that is in the process teardown, not in what is tested
        warnings.warn(f"torchrun exited {proc.returncode} after all cases completed: {proc.stderr[-800:]}")
    data = json.loads(out.read_text())
    return {(r["model"], r["mode"]): r for r in data["records"]}


def generic_native(name):
    from tests.families.test_generic_families import native_model

    return native_model(name)


@pytest.mark.parametrize("mode, model", [(mode, m) for m in MODELS for mode in MODES]
                         + [(mode, m) for m in GENERIC_MODELS for mode in GENERIC_MODES])
def test_sharded_logits_match_whole_model(runs, model, mode):
    rec = runs[model, mode]
    assert "error" not in rec, rec.get("traceback", rec.get("error"))
    assert rec["max_diff"] <= 1e-5, rec
    if mode.endswith("_backward"):
        assert rec["grad_rel_diff"] <= 1e-4, rec  # every parameter, routers included
        assert rec["router_grad_rel_diff"] <= 1e-4, rec
    if mode.endswith("_save"):
        assert rec["saved_max_diff"] <= 1e-6, rec  # the gathered weights, whole again


@pytest.mark.parametrize("model", ["mixtral_zoo", "qwen2_moe_zoo", "deepseek_v3_zoo"])
def test_zoo_experts_are_sharded(runs, model):
    last = {"mixtral_zoo": 1, "qwen2_moe_zoo": 2, "deepseek_v3_zoo": 2}[model]
    experts = f"model.layers.{last}.mlp.experts"
    num_experts = {"mixtral_zoo": 4, "qwen2_moe_zoo": 6, "deepseek_v3_zoo": 8}[model]
    tp = runs[model, "tp"]["placements"]
    assert "_StridedShard(dim=1, sf=2)" in tp[f"{experts}.gate_up_proj"][0]  # gate and up rows, each halved
    assert tp[f"{experts}.down_proj"][0] == "(Shard(dim=2),)"
    for mode in ("tp+ep", "fsdp+ep"):
        ep = runs[model, mode]["placements"]
        assert ep[f"{experts}.gate_up_proj"][1][0] == num_experts // 2  # whole experts, half of them per rank
    if model != "mixtral_zoo":  # shared experts split like a dense MLP
        assert runs[model, "tp"]["placements"][f"model.layers.{last}.mlp.shared_experts.down_proj.weight"][0] == \
            "(Shard(dim=1),)"


def test_kinds_without_a_parallel_form_stay_whole(runs):
    tp = runs["mixed_zoo", "tp"]["placements"]
    assert not any(".mlp.experts." in n for n in tp)  # channel-topk: no TP form (per-token channel selection)
    ep = runs["mixed_zoo", "tp+ep"]["placements"]
    assert ep["model.layers.1.mlp.experts.gate_up_proj"][1][0] == 2  # channel-topk: whole experts per rank
