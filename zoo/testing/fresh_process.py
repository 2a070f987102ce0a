"""The saved models loaded again in one fresh Python process, and its outputs compared with the originals."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from zoo.testing.outputs import max_diff, module_outputs
from zoo.testing.plugins import module_root, register_plugin

# Reload tolerance, relative to the largest |value| of each output compared (every module's, in the order they ran,
# then the logits). The fresh process runs the same fp32 kernels on the same weights and inputs with the same thread
# count, so outputs mostly come back bit-identical; but a loaded tensor's memory alignment can pick another kernel
# path, which changes a linear layer's output in the last bit, and the layers after it carry that on: at most
# 8.6e-7 of an output's largest value over every first-party check (replora on the tiny Qwen2-MoE). Reload bugs
# change a tensor by a bf16 rounding (2^-9) or far more; the mildest, an fp32 buffer cast to bf16 on load
# (tests/checker_toys.py), moved the router's output by 9.2e-4 of its largest value. 2e-5 sits between the two,
# 23x above the one and 46x below the other.
RELOAD_TOLERANCE = 2e-5


def reload_all(cases, plugins, tmp) -> None:
    """Load every saved folder in one fresh process; each case gets ``"reloaded"`` (logits, class, layout, recipe)
    or ``"error"``."""
    from safetensors.torch import load_file, save_file

    if not cases:
        return
    jobs = []
    for n, case in enumerate(cases):
        inputs = os.path.join(tmp, f"inputs-{n}.safetensors")
        save_file({k: v.contiguous() for k, v in case["inputs"].items()}, inputs)
        jobs.append({"folder": case["folder"], "base_folder": case.get("base_folder"), "auto": case["auto"],
                     "inputs": inputs, "out": os.path.join(tmp, f"logits-{n}.safetensors")})
    job = os.path.join(tmp, "job.json")
    Path(job).write_text(json.dumps({"threads": torch.get_num_threads(), "plugins": list(plugins), "cases": jobs}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    roots = [module_root(m) for m in plugins]
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    script = "import sys; from zoo.testing import reload_job; reload_job(sys.argv[1])"
    run = subprocess.run([sys.executable, "-c", script, job], env=env, capture_output=True, text=True)
    results = Path(job + ".out")
    if run.returncode or not results.exists():
        raise AssertionError(f"the fresh process that reloads the saved models failed (exit {run.returncode}): "
                             f"{run.stderr.strip()[-2000:]}")
    for case, job, result in zip(cases, jobs, json.loads(results.read_text())):
        case["reloaded"] = result
        if "error" not in result:
            result["outputs"] = load_file(job["out"])


def reload_job(path: str) -> None:
    """The fresh process's side of ``check_components`` (``python -c`` runs it): load each folder of the job file
    with its Auto class (a PEFT adapter onto its saved base), write its logits on the saved inputs, and its class,
    layout and recipe next to the job file."""
    import traceback

    import transformers
    from safetensors.torch import load_file, save_file

    from zoo.moe.layout import read_layout

    job = json.loads(Path(path).read_text())
    torch.set_num_threads(job["threads"])
    for module in job["plugins"]:
        register_plugin(module)
    out = []
    for case in job["cases"]:
        try:
            if ":" in case["auto"]:
                module, _, qualname = case["auto"].partition(":")
                cls = importlib.import_module(module)
                for part in qualname.split("."):
                    cls = getattr(cls, part)
            else:
                cls = getattr(transformers, case["auto"])
            if case["base_folder"]:  # PEFT's own load; its wrappers hide the layout, the base folder has it
                from peft import PeftModel

                model = PeftModel.from_pretrained(cls.from_pretrained(case["base_folder"]), case["folder"])
                found = {}
            else:
                model = cls.from_pretrained(case["folder"])
                found = {"layout": read_layout(model), "recipe": json.loads(json.dumps(model.config.zoo_recipe or []))}
            save_file({k: v.contiguous() for k, v in module_outputs(model, load_file(case["inputs"])).items()}, case["out"])
            out.append({"class": type(model).__name__, **found})
        except Exception as exc:  # noqa: BLE001 - reported by the checking process
            out.append({"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()})
    Path(path + ".out").write_text(json.dumps(out))


def compare_reloaded(case) -> None:
    where, result = case["where"], case["reloaded"]
    if "error" in result:
        raise AssertionError(f"{where}: loading the saved model in a fresh process (import zoo, "
                             f"{case['auto']}.from_pretrained) failed: {result['error']}")
    if result["class"] != case["class"] and "base_folder" not in case:
        raise AssertionError(f"{where}: the fresh process loaded a {result['class']}, not a {case['class']}.")
    if "layout" in result and json.dumps(result["layout"]) != json.dumps(case["layout"]):
        raise AssertionError(f"{where}: the reloaded layout differs: {result['layout']} instead of {case['layout']}. "
                             "An option the module does not pass up to its base class is not saved.")
    if "recipe" in result and result["recipe"] != case["recipe"]:
        raise AssertionError(f"{where}: the reloaded recipe differs: {result['recipe']} instead of {case['recipe']}.")
    want, got = case["outputs"], result["outputs"]
    case["report"]["max_logit_diff"] = max(case["report"]["max_logit_diff"], max_diff(got["logits"], want["logits"]))
    lost = [k for k in want if k not in got]
    if lost and "base_folder" not in case:  # PEFT's own load wraps the base in its own modules
        raise AssertionError(f"{where}: the model loaded in a fresh process lacks modules that ran in this one: "
                             f"{', '.join(k.split('#')[0] for k in lost[:3])}. Their structure is not saved.")
    for key in [k for k in want if k in got]:  # in the order they ran: the first one to differ is the culprit
        diff = max_diff(got[key], want[key])
        scale = want[key].abs().max().item() if want[key].numel() else 0.0  # (a part given no rows: ERNIE-4.5-VL's)
        if diff > RELOAD_TOLERANCE * max(scale, 1e-6) and _another_call_matches(key, got, want):
            continue  # a module called several times in an order of set iteration (Gemma 4's rotary embedding per
            # layer type): the order follows the string hash, which differs between processes
        if diff > RELOAD_TOLERANCE * max(scale, 1e-6):
            what = "the logits differ" if key == "logits" else f"the output of {key.split('#')[0]} differs"
            raise AssertionError(
                f"{where}: after save_pretrained and a load in a fresh process {what} by up to {diff:.3g} "
                f"(largest value {scale:.3g}). Typical causes: a non-persistent buffer that no init_weights "
                "rebuilds (it comes back as uninitialised memory), a tensor whose dtype changes on load, or an "
                "option not passed to super().__init__ (so not saved).")


def _another_call_matches(key: str, got: dict, want: dict) -> bool:
    """Whether the fresh process's output of this call equals the original output of another call of the same
    module (the same calls, made in another order)."""
    name = key.split("#")[0]
    return any(other != key and other.split("#")[0] == name and want[other].shape == got[key].shape
               and max_diff(got[key], want[other]) <= RELOAD_TOLERANCE * max(want[other].abs().max().item(), 1e-6)
               for other in want)
