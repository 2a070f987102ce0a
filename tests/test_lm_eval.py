"""`moe-zoo eval --tasks`: lm-evaluation-harness on the model the zoo holds, with the zoo's own offline tasks."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import zoo  # noqa: E402
from zoo.data import eval_tasks  # noqa: E402
from zoo.evaluation.harness import TASKS_DIR, check_tasks, run_tasks, task_names  # noqa: E402

FOLDER = Path(zoo.__file__).resolve().parent / "_data" / "models" / "zoo-tiny-moe"
MC, PPL = "zoo_continuation_code", "zoo_perplexity_code"
MC_LIMIT, PPL_LIMIT = 16, 2
CHANCE = 1 / eval_tasks.CHOICES

# plain lm-eval on the saved folder, in a process that never imports zoo
PLAIN = textwrap.dedent("""
    import json, sys
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks_dir, folder, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    lm = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=8)
    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    results = {}
    for task, limit in spec.items():
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                      bootstrap_iters=1000, log_samples=False)
        results.update(out["results"])
    zoo_modules = sorted(m for m in sys.modules if m.split(".")[0] in ("zoo", "zoo_routers", "zoo_compressors"))
    print(json.dumps({"results": results, "zoo_modules": zoo_modules}))
""")


@pytest.fixture(scope="module")
def model():
    import torch

    # float32 (the weights are stored in bf16): bf16 rounding would differ between the zoo block and Mixtral's own
    return zoo.load("zoo-tiny-moe", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def zoo_results(model):
    # one task per call, so each gets its own limit
    return {**run_tasks(model, [MC], limit=MC_LIMIT), **run_tasks(model, [PPL], limit=PPL_LIMIT)}


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / "data" / name).read_text(encoding="utf-8").splitlines()]


def test_tasks_load_offline_from_the_shipped_files():
    from lm_eval.tasks import TaskManager

    manifest = json.loads((TASKS_DIR / eval_tasks.MANIFEST).read_text())
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert manager.all_subtasks == task_names()
    assert len(task_names()) == 6
    loaded = manager.load(task_names())["tasks"]
    for name, task in loaded.items():
        files = task.config.dataset_kwargs["data_files"]
        assert task.config.dataset_path == "json" and list(files) == ["test"]
        assert len(task.eval_docs) == manifest["files"][files["test"]]["rows"]
        assert task.OUTPUT_TYPE == ("multiple_choice" if "continuation" in name else "loglikelihood_rolling")
    doc = loaded[MC].eval_docs[0]
    assert loaded[MC].doc_to_text(doc) == doc["context"] and loaded[MC].doc_to_choice(doc) == doc["choices"]


def test_task_data_is_what_the_builder_makes_from_held_out_text_only():
    assert eval_tasks.check() == []  # deterministic: a rebuild gives the shipped bytes (and checksums)
    manifest = json.loads((TASKS_DIR / eval_tasks.MANIFEST).read_text())
    assert not any(key.endswith("/train") for key in manifest["corpus"])
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    assert total < 400_000
    from zoo.data.corpus import load_text

    train = {d: load_text(d, "train") for d in ("english", "code")}
    for domain in ("english", "code"):
        items = _rows(f"continuation_{domain}_val.jsonl")
        assert len(items) == eval_tasks.MC_ITEMS
        for item in items:
            assert len(item["choices"]) == eval_tasks.CHOICES == len(set(item["choices"]))
            assert 0 <= item["label"] < eval_tasks.CHOICES
            assert item["context"].endswith("\n") and item["context"] not in train[domain]
        labels = {item["label"] for item in items}
        assert labels == set(range(eval_tasks.CHOICES))  # the answer is not always in one place
        for split in ("val", "ood"):
            for row in _rows(f"perplexity_{domain}_{split}.jsonl"):
                assert len(row["text"]) >= eval_tasks.PASSAGE_CHARS and row["text"] not in train[domain]


def test_a_corrupt_data_file_is_refused(tmp_path):
    import shutil

    copy = tmp_path / "tasks"
    shutil.copytree(TASKS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    name = "data/perplexity_code_ood.jsonl"
    (copy / name).write_bytes((copy / name).read_bytes().replace(b"def ", b"def  ", 1))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import local_json; "
            "local_json.load({'test': 'data/perplexity_code_ood.jsonl'})")
    proc = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True)
    assert proc.returncode != 0 and "sha256" in proc.stderr and "MANIFEST.json" in proc.stderr


def test_unknown_task_is_refused_before_any_work():
    with pytest.raises(ValueError, match="did you mean 'zoo_continuation_code'"):
        check_tasks("zoo_continuation_cod")
    with pytest.raises(ValueError, match="unknown task 'hellaswag'"):
        run_tasks(object(), ["hellaswag"])  # never reaches the (not a) model
    with pytest.raises(ValueError, match="at least one task"):
        check_tasks("zoo_perplexity_code,")
    assert check_tasks(f"{PPL}, {MC},{PPL}") == [PPL, MC]
    with pytest.raises(ValueError, match="limit"):
        run_tasks(object(), [MC], limit=0)

    from click.testing import CliRunner

    from zoo.cli import cli

    result = CliRunner().invoke(cli, ["eval", "no-such-model", "--tasks", "zoo_perplexity_englsh"])
    assert result.exit_code == 2 and "did you mean 'zoo_perplexity_english'" in result.output
    result = CliRunner().invoke(cli, ["eval", "no-such-model", "--limit", "3"])
    assert result.exit_code == 2 and "--limit goes with --tasks" in result.output


def test_zoo_tiny_moe_beats_chance_on_the_multiple_choice_task(zoo_results):
    mc = zoo_results[MC]
    assert mc["samples"] == MC_LIMIT
    for metric in ("acc", "acc_norm", "acc_mutual_info"):
        assert 0 <= mc[metric] <= 1 and mc[f"{metric}_stderr"] > 0
    # the true next line is picked far more often than one time in four (two standard errors clear of chance)
    assert mc["acc_mutual_info"] - 2 * mc["acc_mutual_info_stderr"] > CHANCE
    ppl = zoo_results[PPL]
    assert ppl["samples"] == PPL_LIMIT
    assert 1 < ppl["byte_perplexity"] < 8 and ppl["bits_per_byte"] == pytest.approx(math.log2(ppl["byte_perplexity"]))
    assert ppl["word_perplexity"] > ppl["byte_perplexity"] and ppl["bits_per_byte_stderr"] is None


def test_numbers_equal_plain_lm_eval_on_the_saved_folder_in_a_fresh_process(zoo_results, tmp_path):
    spec = json.dumps({MC: MC_LIMIT, PPL: PPL_LIMIT})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", PLAIN, str(TASKS_DIR), str(FOLDER), spec], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plain["zoo_modules"] == []
    for task, metrics in zoo_results.items():
        for name, value in metrics.items():
            if name == "samples":
                continue
            theirs = plain["results"][task][f"{name},none"]
            if value is None:
                assert theirs == "N/A"
            elif name.startswith("acc"):
                assert value == theirs, (task, name)
            else:  # the zoo block and Mixtral's own sum the same experts in another order
                assert value == pytest.approx(theirs, rel=1e-5), (task, name)


def test_a_quantized_model_runs(model, zoo_results):
    import copy

    from zoo.moe.layout import moe_layers

    quantized = zoo.apply(copy.deepcopy(model), "quantize", bits=8)
    kinds = {type(moe.experts).__name__ for _, moe in moe_layers(quantized)}
    assert kinds and not kinds & {type(moe.experts).__name__ for _, moe in moe_layers(model)}
    result = run_tasks(quantized, [PPL], limit=PPL_LIMIT)[PPL]
    base = zoo_results[PPL]["bits_per_byte"]
    # the quantized experts are what ran (a small change), and int8 keeps the model close
    assert result["bits_per_byte"] != base and result["bits_per_byte"] == pytest.approx(base, rel=0.03)


def test_an_offloaded_model_runs(zoo_results):
    from zoo.runtime.offloading import cache_of

    offloaded = zoo.offload("zoo-tiny-moe", cache_experts=4).train()
    result = run_tasks(offloaded, [PPL], limit=PPL_LIMIT)[PPL]
    assert offloaded.training  # HFLM evaluates in eval mode; the model is handed back as it came
    assert result["bits_per_byte"] == pytest.approx(zoo_results[PPL]["bits_per_byte"], rel=1e-2)  # bf16 here
    assert cache_of(offloaded).misses > 0  # experts were read from the checkpoint on demand


def test_results_fit_a_model_cards_model_index(zoo_results):
    from huggingface_hub import ModelCardData

    from zoo.evaluation.harness import card_rows, model_index

    entries = ModelCardData(model_name="zoo-tiny-moe", eval_results=model_index(zoo_results)).to_dict()["model-index"]
    results = {r["dataset"]["config"]: {m["type"]: m["value"] for m in r["metrics"]} for r in entries[0]["results"]}
    assert set(results) == {MC, PPL} and len(card_rows(zoo_results)) == 6
    assert results[MC] == {k: zoo_results[MC][k] for k in ("acc", "acc_norm", "acc_mutual_info")}
    assert results[PPL]["bits_per_byte"] == zoo_results[PPL]["bits_per_byte"]


def test_eval_command_prints_and_returns_tasks():
    from click.testing import CliRunner

    from zoo.cli import cli

    args = ["eval", "zoo-tiny-moe", "--windows", "1", "--no-speed", "--tasks", PPL, "--limit", "1"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert set(out["tasks"]) == {PPL} and out["tasks"][PPL]["samples"] == 1 and "perplexity" in out
    table = CliRunner().invoke(cli, args)
    assert table.exit_code == 0 and f"{PPL}  bits_per_byte" in table.output
