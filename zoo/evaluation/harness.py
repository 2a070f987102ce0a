"""lm-evaluation-harness on the model object the zoo holds: ``run_tasks(model, ["zoo_continuation_code"])``.

The model in memory (converted, quantized, offloaded, with an adapter) is wrapped in lm-eval's own Hugging Face
wrapper (``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tokenizer)``) and evaluated with
``lm_eval.simple_evaluate``, so the numbers are lm-eval's and no copy of the model is loaded from disk. The tasks
are the zoo's own (``zoo/_data/tasks``, built from the held-out corpus by ``zoo.data.eval_tasks``): nothing is
downloaded, and plain lm-eval runs the same YAMLs with ``TaskManager(include_path=TASKS_DIR)``.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager

from zoo.data.eval_tasks import TASKS_DIR
from zoo.components.options import check_int, suggest

BATCH_SIZE = 8
LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"


def task_names() -> list[str]:
    """The zoo's lm-eval tasks (each YAML is named after the task it defines); cheap: lm-eval is not imported."""
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def check_tasks(tasks) -> list[str]:
    """``tasks`` (a list of names, or one comma-separated string) as a list of known task names, each once, in the
    order given; an unknown or empty name is a ValueError with close matches, before any work."""
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    known = task_names()
    if not names or not all(names):
        raise ValueError(f"name at least one task (known: {', '.join(known)})")
    for name in names:
        if name not in known:
            raise ValueError(f"unknown task {name!r}{suggest(name, known)} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def task_manager():
    """lm-eval's ``TaskManager`` over the zoo's tasks only (lm-eval's own hundreds are not indexed)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@contextmanager
def _quiet(level=logging.ERROR):
    """lm-eval's info and warnings (about a model passed as an object, custom datasets) held back meanwhile."""
    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def task_metrics(results: dict, samples: dict) -> dict:
    """lm-eval's ``results`` (keys ``"acc,none"``, ``"acc_stderr,none"``) as ``{task: {metric: value,
    metric_stderr: value or None, "samples": n}}``; lm-eval gives no stderr for perplexities (None)."""
    out = {}
    for task, row in results.items():
        metrics = {}
        for key, value in row.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr"):
                continue
            stderr = row.get(f"{name}_stderr,{filt}")
            metrics[name] = value
            metrics[f"{name}_stderr"] = stderr if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None
        out[task] = {**metrics, "samples": samples.get(task, {}).get("effective")}
    return out


def run_tasks(model, tasks, tokenizer=None, limit: int | None = None, batch_size: int = BATCH_SIZE,
              bootstrap_iters: int = 1000) -> dict:
    """Run the zoo's lm-eval ``tasks`` (names from ``task_names()``) on ``model`` as it is in memory.

    ``tokenizer``: the model's own by default (``zoo.io.loading.tokenizer_for``). ``limit``: at most this many
    documents per task (the first ones). Returns ``{task: {metric: value, metric_stderr: value, "samples": n}}``:
    acc, acc_norm and acc_mutual_info for the ``zoo_continuation_*`` tasks (acc_mutual_info scores each choice by
    its log-likelihood after the context minus its log-likelihood alone, so a line that is likely anywhere does not
    win: it measures the use of the context), word_perplexity, byte_perplexity and bits_per_byte (no stderr from
    lm-eval: None) for the ``zoo_perplexity_*`` ones. Names and numbers are checked before any work; the model is
    left in the mode it was in."""
    from zoo.io.loading import check_tokenizer, tokenizer_for

    names = check_tasks(tasks)
    if limit is not None:
        check_int("limit", limit, 1)
    check_int("batch_size", batch_size, 1)
    check_int("bootstrap_iters", bootstrap_iters, 0)
    if tokenizer is None:
        tokenizer = tokenizer_for(model, required=True)
    else:
        check_tokenizer(tokenizer, model, "the tokenizer given")
    training = getattr(model, "training", False)
    try:
        with _quiet():
            import lm_eval
            from lm_eval.models.huggingface import HFLM

            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)  # puts the model in eval mode
            # the tasks draw nothing at random: the caller's random, numpy and torch generators are left alone
            out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=task_manager(), limit=limit,
                                          bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=None,
                                          numpy_random_seed=None, torch_random_seed=None)
    finally:
        if training:
            model.train()
    return task_metrics(out["results"], out.get("n-samples", {}))


def _values(metrics: dict):
    """``(metric, value, stderr)`` of one task's result."""
    for name, value in metrics.items():
        if name != "samples" and not name.endswith("_stderr"):
            yield name, value, metrics.get(f"{name}_stderr")


def format_tasks(tasks: dict) -> str:
    """A text table of ``run_tasks``' result: one row per task and metric, value +- stderr."""
    rows = [(task, name, f"{value:.4f}" + (f" +- {stderr:.4f}" if stderr is not None else ""),
             str(metrics.get("samples") or ""))
            for task, metrics in tasks.items() for name, value, stderr in _values(metrics)]
    header = ("task", "metric", "value", "docs")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def model_index(tasks: dict) -> list:
    """``run_tasks``' result as huggingface_hub ``EvalResult``s for a model card's ``model-index``: one per task and
    metric, each naming the zoo task (its data: the held-out corpus) and lm-evaluation-harness as its source."""
    from importlib.metadata import version

    from huggingface_hub import EvalResult

    split = {True: "out-of-domain", False: "validation"}
    return [EvalResult(task_type="text-generation", dataset_type="moe-zoo-tasks", dataset_name=f"moe-zoo {task}",
                       dataset_config=task, dataset_split=split[task.endswith("_ood")], metric_type=name,
                       metric_value=value, metric_config=f"documents={metrics['samples']}" if metrics.get("samples")
                       else None, source_name=f"lm-evaluation-harness {version('lm-eval')}", source_url=LM_EVAL_URL)
            for task, metrics in tasks.items() for name, value, _ in _values(metrics)]


def card_rows(tasks: dict) -> list[tuple[str, str]]:
    """``(label, value)`` rows of ``run_tasks``' result for a card's results table."""
    return [(f"{task} {name}", f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else ""))
            for task, metrics in tasks.items() for name, value, stderr in _values(metrics)]


__all__ = ["run_tasks", "task_names", "check_tasks", "task_manager", "format_tasks", "model_index", "card_rows",
           "TASKS_DIR"]
