"""Model cards: ``zoo.card(model)`` renders ``cards/`` templates with huggingface_hub's ModelCard."""
from __future__ import annotations

import functools
import json
import os
import re
import warnings

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from zoo.components.resources import resource_path


@functools.lru_cache(maxsize=256)
def _template(text: str) -> jinja2.Template:
    """A card template compiled once (each save writes a card; compiling took most of rendering one)."""
    return jinja2.Template(text)


def _layout_summary(layout) -> str:
    parts = []
    for i, e in enumerate(layout or []):
        parts.append(f"L{i}: dense" if not e else
                     f"L{i}: {e['num_experts']} x {e['experts']} experts, {e['router']} top-{e['num_experts_per_tok']}")
    return "; ".join(parts) or "no MoE layers"


# the Auto class a family's checkpoints load with (``Family.auto``), as the card's snippet names it
AUTO_CLASS_NAMES = {"causal-lm": "AutoModelForCausalLM", "image-text-to-text": "AutoModelForImageTextToText",
                    "seq2seq-lm": "AutoModelForSeq2SeqLM", "multimodal-lm": "AutoModelForMultimodalLM"}
ARXIV = re.compile(r"arxiv(?:\.org/(?:abs|pdf)/|:)\s*(\d{4}\.\d{4,5})", re.IGNORECASE)


def unique_citations(papers) -> list[str]:
    """Each citation once, in order of first mention. A ``paper`` string may hold several citations separated by
    "; "; one whose arXiv ids were all cited already (or, without an arXiv id, whose words were) is left out."""
    out, seen_ids, seen_text = [], set(), set()
    for paper in papers:
        for item in filter(None, (part.strip() for part in (paper or "").split("; "))):
            ids = set(ARXIV.findall(item))
            words = " ".join(re.findall(r"\w+", item.lower()))
            if (ids and ids <= seen_ids) or (not ids and words in seen_text):
                continue
            seen_ids |= ids
            seen_text.add(words)
            out.append(item)
    return out


def card_title(model_name: str | None = None, repo_id: str | None = None, path: str | None = None,
               base_model: str | None = None, family: str = "") -> str:
    """The card's title: the given name, else the repo's name, else the folder's, else the base model's."""
    if model_name and model_name.strip():
        return model_name.strip()
    for candidate in (repo_id, path and os.path.normpath(os.fspath(path)), base_model):
        name = str(candidate or "").replace("\\", "/").rstrip("/").split("/")[-1]
        if name and name not in (".", ".."):
            return name
    return f"zoo-{family}"


def card(model, eval_result: dict | None = None, repo_id: str | None = None, model_name: str | None = None,
         summary: str | None = None, path: str | os.PathLike | None = None) -> ModelCard:
    """A ModelCard for a zoo model: metadata (base_model, library_name, tags, model-index), the recipe
    with its calibration data, evaluation results, how to load it, and every component's citation.
    ``repo_id`` (a Hub repo) or ``path`` (the folder it is saved to) is what the "How to load" snippet loads, and
    names the card unless ``model_name`` is given. A PEFT model gets the card of an adapter folder: its base
    model's recipe, ``base_model`` only when the base is on the Hub, and how to load and merge it."""
    from zoo.moe.layout import components_provenance, family_and_base, read_layout
    from zoo.components.registry import registry

    adapter_base = None
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # a PEFT adapter on a zoo model
        adapter_base = model.peft_config[model.active_adapter].base_model_name_or_path or None
        model = model.get_base_model()
    fam, _ = family_and_base(model)
    if fam is None:
        raise TypeError(f"zoo.card takes a zoo model, not {type(model).__name__}: zoo.convert(model) first")
    cfg = model.config
    layout, recipe = read_layout(model), list(cfg.zoo_recipe or [])
    used = [("architecture", fam.name)] + [("router", n) for n in sorted({e["router"] for e in layout if e})]
    used = list(dict.fromkeys(used + [(s["kind"], s["name"]) for s in recipe]))  # each component once, in order
    comps = [registry.by_kind[k][n] for k, n in used if n in registry.by_kind.get(k, {})]
    arch = registry.find("architecture", fam.name)
    sources = [*components_provenance(cfg).values(), *([arch.provenance] if arch else [])]
    packages = sorted({(s["distribution"], s["version"]) for s in sources if s["distribution"] != "moe-zoo"})
    reason = fam.export_problem(cfg, layout)
    exportable, reason = reason is None, reason or ""
    from zoo.architectures.native import export_padding

    padding = export_padding(model) if exportable else None
    base = getattr(cfg, "zoo_base_model", None)
    if adapter_base is not None:
        from zoo.io.adapter_folder import hub_id_of

        base = hub_id_of(adapter_base)  # a card names a Hub id as its base_model, never a local path
    name = card_title(model_name, repo_id, path, base, fam.name)
    target = repo_id or (os.fspath(path) if path is not None else "PATH")
    results = []
    source = source_entry(cfg, base)
    tags = ["moe", "mixture-of-experts", "moe-zoo", fam.name] + [c.name for c in comps[1:]]
    if adapter_base is None:
        tags.append("custom_code")  # the folder's auto_map imports the installed moe-zoo (zoo.architectures.remote_code)
    data = ModelCardData(library_name="peft" if adapter_base is not None else "transformers", base_model=base,
                         base_model_relation=base_relation(recipe, adapter_base) if base else None,
                         license=source.license if source is not None else None, pipeline_tag="text-generation",
                         tags=list(dict.fromkeys(tags)))
    if eval_result:
        data.model_name = name
        data.eval_results = [
            EvalResult(task_type="text-generation", dataset_type="moe-zoo-corpus", dataset_name=f"moe-zoo corpus ({d})",
                       dataset_config=d, dataset_split="validation", metric_type="perplexity", metric_value=v)
            for d, v in eval_result["perplexity"].items()]
        results = [(f"perplexity ({d})", f"{v:.2f}") for d, v in eval_result["perplexity"].items()]
        for d, v in (eval_result.get("perplexity_ood") or {}).items():
            data.eval_results.append(EvalResult(
                task_type="text-generation", dataset_type="moe-zoo-corpus", dataset_name=f"moe-zoo corpus ({d})",
                dataset_config=d, dataset_split="out-of-domain", metric_type="perplexity", metric_value=v))
            results.append((f"perplexity ({d}, out of domain)", f"{v:.2f}"))
        if eval_result.get("tasks"):  # lm-evaluation-harness results (moe-zoo eval --tasks)
            from zoo.evaluation.harness import card_rows, model_index

            data.eval_results += model_index(eval_result["tasks"])
            results += card_rows(eval_result["tasks"])
        size = eval_result.get("size")
        if size:
            results += [("parameters", f"{size['params'] / 1e6:.2f} M"),
                        ("active parameters / token", f"{size['active_params'] / 1e6:.2f} M"),
                        ("bytes", f"{size['bytes'] / 1e6:.1f} MB")]
    context = {"family": fam.name, "layout_summary": _layout_summary(layout), "recipe": recipe}
    sections = [section for c in comps if getattr(c.obj, "card", "")
                for section in [render_component_card(c.obj, context, missing_ok=True)] if section]
    citations = unique_citations(getattr(c.obj, "paper", "") for c in comps)
    fields = dict(
        model_name=name, summary=summary or f"A {fam.name} Mixture-of-Experts model built with moe-zoo.",
        recipe=recipe, results=results, sections=sections, repo_id=target,
        load_from=json.dumps(target, ensure_ascii=False), family=fam.name, exportable=exportable,
        export_reason=reason, padding=padding, citations=citations, packages=packages, adapter_base=adapter_base,
        ood=bool(eval_result and eval_result.get("perplexity_ood")),
        auto_loads=arch is None or arch.distribution == "moe-zoo",
        auto_class=AUTO_CLASS_NAMES[getattr(fam, "auto", "causal-lm")])
    # what ModelCard.from_template renders (the card data's fields, the YAML header as card_data, the keywords
    # last), on the template compiled once
    template = _template(resource_path("cards/base.md").read_text(encoding="utf-8"))
    rendered = template.render({**data.to_dict(), "card_data": data.to_yaml(), **fields})
    return ModelCard(tidy(rendered))


def source_entry(cfg, base: str | None):
    """The registry entry the model comes from (its Hub id, or the shipped folder it was loaded from), for its license;
    None when the zoo knows no entry."""
    from zoo.components.registry import registry

    origin = os.path.realpath(str(getattr(cfg, "name_or_path", "") or "")) or None
    for reg in registry.by_kind.get("model", {}).values():
        entry = reg.obj
        if (base and entry.hub_id == base) or (entry.local_path and origin == os.path.realpath(entry.local_path)):
            return entry
    return None


def base_relation(recipe: list, adapter_base) -> str:
    """How the Hub relates the model to its ``base_model``: an adapter, a quantized model, or a fine-tune (training,
    pruning, merging of experts or a router swap change the weights or the function: the Hub's "finetune")."""
    if adapter_base is not None:
        return "adapter"
    kinds = {(step.get("kind"), step.get("name")) for step in recipe}
    if kinds and all(name == "quantize" for _, name in kinds):
        return "quantized"
    return "finetune"


def tidy(text: str) -> str:
    """No trailing spaces, no runs of blank lines, one newline at the end."""
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def render_component_card(component, context: dict | None = None, missing_ok: bool = False) -> str:
    """A component's own card section (its ``card`` template), rendered with ``context``, then its verdicts on
    its paper's claims (``zoo.evaluation.claims``). ``missing_ok``: a template its package does not ship is warned about and
    left out (a save never fails for a card)."""
    try:
        text = resource_path(component.card, owner=component).read_text()
    except FileNotFoundError as exc:
        if not missing_ok:
            raise
        warnings.warn(f"{component.name}: its card section is left out ({exc})", stacklevel=2)
        return ""
    from zoo.evaluation.claims import card_section

    rendered = _template(text).render(**(context or {})).rstrip("\n")
    verdicts = card_section(component)
    return f"{rendered}\n\n{verdicts}" if verdicts else rendered + "\n"
