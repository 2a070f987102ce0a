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
folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
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
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_foreign_process_loads_the_folder(family, tmp_path):
    model = zoo.convert(tiny_native(family)).eval()
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == f"{CODE_FILE[:-3]}.{type(model).__name__}"
    with torch.no_grad():
        want = model(input_ids=torch.tensor(IDS)).logits
    out = foreign(LOAD, tmp_path / "m", json.dumps(IDS), cwd=tmp_path)
    assert "trust_remote_code=True" in out["without"]
    assert out["cls"] == type(model).__name__ and out["base"] == type(model.model).__name__
    assert out["config"] == type(model.config).__name__
    for key in ("logits", "auto_logits"):
        torch.testing.assert_close(torch.tensor(out[key]), want, rtol=0, atol=1e-5)


def test_the_native_export_carries_no_auto_map(tmp_path):
    model = zoo.convert(tiny_native("mixtral"))
    zoo.export(model, tmp_path / "native")
    assert "auto_map" not in json.loads((tmp_path / "native" / "config.json").read_text())
    assert not (tmp_path / "native" / CODE_FILE).exists()


PIPELINE = """
import json, sys
from transformers import pipeline
generate = pipeline("text-generation", model=sys.argv[1], trust_remote_code=True)
text = generate("def main():", max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
ids = generate.tokenizer("def main():" + text)["input_ids"]
print("RESULT " + json.dumps({"text": text, "ids": ids}))
"""


def test_a_quantized_model_generates_the_zoos_tokens_in_a_pipeline(tmp_path):
    from zoo.io.loading import tokenizer_for

    model = zoo.apply(zoo.load("zoo-tiny-moe", dtype=torch.float32), "quantize", bits=8).eval()
    model.save_pretrained(tmp_path / "q")
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    tokenizer = tokenizer_for(model)
    prompt = tokenizer("def main():", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
    out = foreign(PIPELINE, tmp_path / "q", cwd=tmp_path)
    assert out["text"] == tokenizer.decode(want)


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


LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
folder, tasks_dir = sys.argv[1], sys.argv[2]
out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32,device=cpu",
                              tasks=["zoo_continuation_code"], task_manager=TaskManager(include_path=tasks_dir,
                              include_defaults=False), limit=8, bootstrap_iters=0, log_samples=False)
result = out["results"]["zoo_continuation_code"]
print("RESULT " + json.dumps({"acc": result["acc,none"], "mi": result["acc_mutual_info,none"]}))
"""


def test_lm_eval_hf_model_opens_a_quantized_zoo_folder(tmp_path):
    """lm-eval's own ``hf`` model (``pretrained=DIR,trust_remote_code=True``), as its docs teach it, on a zoo folder
    with int8 experts: the same numbers as the zoo's run_tasks on the model in memory."""
    from zoo.data.eval_tasks import TASKS_DIR
    from zoo.evaluation.harness import run_tasks

    model = zoo.apply(zoo.load("zoo-tiny-moe", dtype=torch.float32), "quantize", bits=8).eval()
    model.save_pretrained(tmp_path / "q")
    want = run_tasks(model, ["zoo_continuation_code"], limit=8, bootstrap_iters=0)["zoo_continuation_code"]
    out = foreign(LM_EVAL, tmp_path / "q", TASKS_DIR, cwd=tmp_path)
    assert (out["acc"], out["mi"]) == (want["acc"], want["acc_mutual_info"])
