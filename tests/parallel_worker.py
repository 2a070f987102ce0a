"""Run under ``torchrun --nproc-per-node 2`` (CPU, gloo): load saved tiny models sharded by transformers' own
distributed machinery and compare their logits with the same folder loaded whole.

    torchrun --nproc-per-node 2 tests/parallel_worker.py OUT.json NAME=FOLDER[,MODE...] ...

MODE is one of ``MODES``; the default is all of them. Rank 0 writes ``OUT.json``: one record per (model, mode)
with ``max_diff`` (max |logit difference| over the batch), the sharded parameters' placements of one MoE layer,
and ``error`` where the load or forward raised; ``*_backward`` modes also compare the gradients of every parameter
(``grad_rel_diff``: max over parameters of max |g - g_ref| / max |g_ref|, routers alone in ``router_grad_rel_diff``).
It never asserts: tests/test_parallel.py does.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zoo  # noqa: E402,F401  (registers the zoo model types)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

IDS = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44, 21, 8], [1, 8, 21, 66, 12, 90, 4, 7, 100, 55]])

# what each mode passes to from_pretrained, on 2 ranks
MODES = {
    # tensor parallel, the model's plan: attention, experts (gate_up by output, down by input), shared experts
    "tp": dict(tp_plan="auto"),
    # expert parallel (2 experts groups) with the dense modules tensor parallel; inference picks all_reduce
    "tp+ep": dict(distributed_config=dict(tp_size=2, ep_size=2)),
    # the same with the token exchange used for training / data parallel
    "tp+ep_all_to_all": dict(distributed_config=dict(tp_size=2, ep_size=2, ep_implementation="all_to_all")),
    # expert parallel with FSDP for the rest: each rank holds its own batch (rank r: row r), tokens all-to-all
    "fsdp+ep": dict(distributed_config=dict(fsdp_size=2, ep_size=2)),
    # training: gradients through the sharded experts (routing weights' gradients summed across ranks)
    "tp_backward": dict(tp_plan="auto"),
    "tp+ep_backward": dict(distributed_config=dict(tp_size=2, ep_size=2)),  # auto picks all_to_all with grads
    # save_pretrained from the sharded model (weights gathered, zoo_layout with the global expert counts),
    # then the saved folder loaded whole
    "tp+ep_save": dict(distributed_config=dict(tp_size=2, ep_size=2)),
}
DEFAULT_MODES = list(MODES)


def patch_factory_plans():
    """Put the zoo plans on the zoo config classes if the factory does not yet (see zoo.architectures.parallel)."""
    from zoo.architectures.factory import _CLASSES
    from zoo.architectures.parallel import parallel_attributes

    patched = []
    for cfg_cls, _, lm_cls in _CLASSES.values():
        for attr, value in parallel_attributes(lm_cls.zoo_family).items():
            if cfg_cls.__dict__.get(attr) != value:
                setattr(cfg_cls, attr, value)
                patched.append(f"{cfg_cls.__name__}.{attr}")
    return patched


def load(path, mode):
    kwargs = dict(MODES[mode])
    if "distributed_config" in kwargs:
        kwargs["distributed_config"] = DistributedConfig(**kwargs["distributed_config"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= is deprecated for distributed_config=
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def placements(model):
    """Sharded parameters of the last layer: name -> (placements, local shape)."""
    from torch.distributed.tensor import DTensor

    last = f".layers.{model.config.num_hidden_layers - 1}."
    return {name: [str(tuple(p.placements)), list(p.to_local().shape)]
            for name, p in model.named_parameters() if isinstance(p, DTensor) and last in name}


def gradients(model, ids):
    """Full gradients of every parameter for a fixed probe of the logits."""
    from torch.distributed.tensor import DTensor

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits.float() * probe).sum().backward()
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def run_case(path, mode, ref, scratch):
    model = load(path, mode)
    rank = dist.get_rank()
    ids = IDS[rank:rank + 1] if mode.startswith("fsdp") else IDS
    want = ref["logits"][rank:rank + 1] if mode.startswith("fsdp") else ref["logits"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    diff = (logits.float() - want.float()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # the worst rank
    rec = {"max_diff": diff.item(), "placements": placements(model)}
    if mode.endswith("_backward"):
        got, grads = gradients(model, ids), ref["grads"]()
        rel = {n: ((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() if n in got else float("inf")
               for n, g in grads.items()}
        rec["grad_rel_diff"] = max(rel.values())
        rec["worst_grad"] = max(rel, key=rel.get)
        rec["router_grad_rel_diff"] = max(v for n, v in rel.items() if ".router." in n or ".mlp.gate." in n)
    if mode.endswith("_save"):
        model.save_pretrained(scratch)
        dist.barrier()
        with torch.no_grad():
            again = AutoModelForCausalLM.from_pretrained(scratch).eval()(input_ids=IDS).logits
        saved = (again - ref["logits"]).abs().max()
        dist.all_reduce(saved, op=dist.ReduceOp.MAX)
        rec["saved_max_diff"] = saved.item()
        dist.barrier()
    return rec


def reference(path):
    """The folder loaded whole: its logits, and its gradients (computed on first use)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    cache = {}

    def grads():
        if "g" not in cache:
            cache["g"] = gradients(model, IDS)
        return cache["g"]

    return {"logits": logits, "grads": grads}


def main():
    out_path, specs = sys.argv[1], sys.argv[2:]
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    patched = patch_factory_plans()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    records = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        path, *modes = rest.split(",")
        ref = reference(path)
        for mode in modes or DEFAULT_MODES:
            start = time.perf_counter()
            try:
                scratch = os.path.join(os.path.dirname(os.path.abspath(out_path)), f"saved-{name}-{mode}")
                rec = run_case(path, mode, ref, scratch)
            except Exception as e:  # reported, not raised: the other cases still run
                rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            rec.update(model=name, mode=mode, seconds=round(time.perf_counter() - start, 2))
            records.append(rec)
            if rank == 0:
                print(json.dumps({k: v for k, v in rec.items() if k not in ("traceback", "placements")}),
                      flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"patched": patched, "records": records}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
