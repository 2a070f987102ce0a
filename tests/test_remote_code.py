"""A zoo folder opens in a transformers process that never imports zoo itself (``auto_map`` + the small code file a
save writes): the same logits and tokens as the zoo, under Auto classes, pipelines and ``device_map="auto"``; without
``trust_remote_code`` or without moe-zoo the error says what to pass or install."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zoo
from tiny import tiny_native
from zoo.architectures.remote_code import CODE_FILE

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning")]
IDS = [[5, 9, 17, 33, 2, 64, 100, 7]]


def foreign(script: str, *args, cwd) -> dict:
    """Run ``script`` in a fresh interpreter (its own code never imports zoo); it prints one JSON line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "hf-modules"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.rsplit("RESULT ", 1)[1])  # (transformers' prompt may share the line)


LOAD = """
import json, sys, torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
ids, results = torch.tensor(json.loads(sys.argv[1])), {}
for folder in sys.argv[2:]:
    out = {}
    try:
        AutoModelForCausalLM.from_pretrained(folder)
    except ValueError as exc:
        out["without"] = str(exc)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    auto = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, device_map="auto").eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        out["logits"] = model(input_ids=ids).logits.tolist()
        out["auto_logits"] = auto(input_ids=ids).logits.tolist()
    out.update(cls=type(model).__name__, base=type(base).__name__, config=type(AutoConfig.from_pretrained(
        folder, trust_remote_code=True)).__name__)
    results[folder] = out
print("RESULT " + json.dumps(results))
"""


def test_a_foreign_process_loads_the_folders(tmp_path):
    """Mixtral's and DeepSeek-V3's zoo folders, in one fresh process that never imports zoo itself."""
    models, wants = {}, {}
    for family in ("mixtral", "deepseek_v3"):
        model = zoo.convert(tiny_native(family)).eval()
        model.save_pretrained(tmp_path / family)
        config = json.loads((tmp_path / family / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == f"{CODE_FILE[:-3]}.{type(model).__name__}"
        with torch.no_grad():
            wants[family] = model(input_ids=torch.tensor(IDS)).logits
        models[family] = model
    results = foreign(LOAD, json.dumps(IDS), *(tmp_path / f for f in models), cwd=tmp_path)
    # without the flag the first folder is refused with what to pass; after it, the process has imported moe-zoo
    # (the first folder's code did), which registered the zoo types: the second opens even without the flag
    assert "trust_remote_code=True" in results[str(tmp_path / "mixtral")]["without"]
    assert "without" not in results[str(tmp_path / "deepseek_v3")]
    for family, model in models.items():
        out = results[str(tmp_path / family)]
        assert out["cls"] == type(model).__name__ and out["base"] == type(model.model).__name__
        assert out["config"] == type(model.config).__name__
        for key in ("logits", "auto_logits"):
            torch.testing.assert_close(torch.tensor(out[key]), wants[family], rtol=0, atol=1e-5)


def test_the_native_export_carries_no_auto_map(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))
    zoo.export(model, tmp_path / "native")
    assert "auto_map" not in json.loads((tmp_path / "native" / "config.json").read_text())
    assert not (tmp_path / "native" / CODE_FILE).exists()


QUANTIZED = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
from transformers import pipeline
folder, tasks_dir = sys.argv[1], sys.argv[2]
generate = pipeline("text-generation", model=folder, trust_remote_code=True)
text = generate("def main():", max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32,device=cpu",
                              tasks=["zoo_continuation_code"], task_manager=TaskManager(include_path=tasks_dir,
                              include_defaults=False), limit=8, bootstrap_iters=0, log_samples=False)
result = out["results"]["zoo_continuation_code"]
print("RESULT " + json.dumps({"text": text, "acc": result["acc,none"], "mi": result["acc_mutual_info,none"]}))
"""


def test_a_quantized_zoo_folder_in_a_pipeline_and_in_lm_evals_hf_model(tmp_path):
    """A zoo folder with int8 experts, opened as users of each tool do (one fresh process for both): a transformers
    pipeline generates the zoo's greedy tokens, and lm-eval's own ``hf`` model (``pretrained=DIR,
    trust_remote_code=True``) gives the numbers the zoo's run_tasks gives on the model in memory."""
    from zoo.data.eval_tasks import TASKS_DIR
    from zoo.evaluation.harness import run_tasks
    from zoo.io.loading import tokenizer_for

    model = zoo.apply(zoo.load("zoo-tiny-moe", dtype=torch.float32), "quantize", bits=8).eval()
    model.save_pretrained(tmp_path / "q")
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    tokenizer = tokenizer_for(model)
    prompt = tokenizer("def main():", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
    want = run_tasks(model, ["zoo_continuation_code"], limit=8, bootstrap_iters=0)["zoo_continuation_code"]
    out = foreign(QUANTIZED, tmp_path / "q", TASKS_DIR, cwd=tmp_path)
    assert out["text"] == tokenizer.decode(tokens)
    assert (out["acc"], out["mi"]) == (want["acc"], want["acc_mutual_info"])


NO_ZOO = """
import json, sys
import importlib.abc
class NoZoo(importlib.abc.MetaPathFinder):  # as if moe-zoo were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "zoo" or name.startswith("zoo."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoZoo())
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ImportError as exc:
    print("RESULT " + json.dumps({"error": str(exc)}))
"""


def test_without_moe_zoo_the_error_says_to_install_it(tmp_path):
    zoo.convert(tiny_native("mixtral")).save_pretrained(tmp_path / "m")
    out = foreign(NO_ZOO, tmp_path / "m", cwd=tmp_path)
    assert "pip install moe-zoo" in out["error"]
