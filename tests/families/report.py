"""Write docs/families.md: every MoE family of the installed transformers and what the zoo does with it, measured.

    .venv/bin/python tests/families/report.py          # convert each family's tiny model, write docs/families.md
    .venv/bin/python tests/families/report.py -o -     # print instead

For each converted family: the tiny model (from the family's own config class, ``tiny_configs.py``) is converted,
and the table gives the zoo router the probe chose, the experts' activation, the largest relative logit error
against the native model (fp32) and whether the greedy tokens agree. Each exception gives its reason
(``zoo.architectures.families.EXCEPTIONS``).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))


def measure(model_type: str) -> dict:
    import torch

    import zoo
    from tests.families.test_generic_families import greedy, input_ids, logits, native_model, rel
    from zoo.moe.layout import moe_layers
    from zoo.moe.modality import ModalityMoE

    native = native_model(model_type)
    ids = input_ids(native)
    run = logits
    if native.config.is_encoder_decoder:  # seq2seq (Switch Transformers): the decoder reads the same ids
        native.config.decoder_start_token_id = native.generation_config.decoder_start_token_id = 0

        def run(model, ids):
            with torch.no_grad():
                return model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits.float()
    if getattr(native.config, "canvas_length", None):  # block diffusion (Diffusion Gemma): a given canvas, and its own
        canvas = input_ids(native, length=native.config.canvas_length)  # generation from one seed (a random canvas)

        def run(model, ids):
            with torch.no_grad():
                return model(input_ids=ids, decoder_input_ids=canvas).logits.float()

        def greedy(model, ids):
            torch.manual_seed(0)
            with torch.no_grad():
                return model.generate(input_ids=ids, max_new_tokens=8, max_denoising_steps=4).sequences
    if hasattr(native, "thinker"):  # Qwen3-Omni: no forward of its own; its thinker's text (tests/test_qwen3_omni.py
        def run(model, ids):  # checks the talker too)
            return logits(model.thinker, ids)

        def greedy(model, ids):
            with torch.no_grad():
                return model.thinker.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want, tokens = run(native, ids), greedy(native, ids[:1])
    model = zoo.convert(native)
    moe = moe_layers(model)
    entry = moe[0][1].layout()
    # decoder layers holding MoE parts (ERNIE-4.5-VL's per-modality parts are layout entries of their own, inside a
    # ModalityMoE whose shared MLP is the layer's)
    holders = [m for m in model.modules() if isinstance(m, ModalityMoE)]
    if holders:
        moe_count = f"{len(holders)}/{len(model.get_decoder().layers)}"
        shared = entry["shared_experts"] is not None or any(h.shared_experts is not None for h in holders)
    else:
        moe_count, shared = f"{len(moe)}/{len(model.config.zoo_layout)}", entry["shared_experts"] is not None
    return {"auto": type(model).zoo_family.auto, "router": entry["router"], "activation": entry["experts_options"].get("activation", "silu"),
            "moe_layers": moe_count, "shared": shared,
            "error": rel(run(model, ids), want), "greedy": bool(torch.equal(greedy(model, ids[:1]), tokens))}


def render(rows: dict, exceptions: dict, counts: dict) -> str:
    lines = ["# MoE families of transformers in the zoo", "",
             f"Written by `tests/families/report.py` on {datetime.date.today()} (transformers "
             f"{counts['transformers']}). Every row is measured on a tiny random model built from the family's own "
             "config class: the zoo router the conversion found, the experts' activation, MoE layers converted of "
             "all decoder layers, the relative logit error against the native model (fp32) and whether greedy "
             "decoding picks the same tokens.", "",
             f"MoE config classes found: {counts['found']}; with a causal-LM, image-text-to-text, multimodal or "
             f"seq2seq class: {counts['with_class']}; of these built as tiny random models from their own config "
             f"classes: {counts['instantiable']}; converted: {counts['converted']} ({counts['first_party']} by "
             f"first-party specs, {counts['generic']} by the generic adapter); not converted: {counts['excepted']}.",
             "", "## Converted", "",
             "| model type | loads with | router | activation | MoE layers | shared | logit error | greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for t, r in sorted(rows.items()):
        lines.append(f"| {t} | {r['auto']} | {r['router']} | {r['activation']} | {r['moe_layers']} | "
                     f"{'yes' if r['shared'] else 'no'} | {r['error']:.1e} | {'same' if r['greedy'] else 'DIFFERS'} |")
    lines += ["", "## Not converted", "", "| model type | why |", "|---|---|"]
    lines += [f"| {t} | {why} |" for t, why in sorted(exceptions.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=str(ROOT / "docs" / "families.md"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto import modeling_auto as ma

    from tests.families.test_generic_families import moe_model_types
    from tests.families.tiny_configs import model_class
    from zoo.architectures.families import EXCEPTIONS, FIRST_PARTY, GENERIC

    found = moe_model_types()
    mappings = [ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                getattr(ma, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}),
                ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES]
    with_class = {t for t in found if any(t in m for m in mappings)}
    from tests.families.test_generic_families import native_model

    instantiable = set()
    for t in sorted(with_class):
        try:
            native_model(t)
            instantiable.add(t)
        except Exception as exc:  # noqa: BLE001 - the reason goes into the report
            print(f"{t}: not instantiable tiny: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    rows = {}
    for t in sorted(set(FIRST_PARTY) | set(GENERIC)):
        if model_class(t) is None:
            continue
        print(t, file=sys.stderr)
        rows[t] = measure(t)
    counts = {"transformers": transformers.__version__, "found": len(found), "with_class": len(with_class),
              "instantiable": len(instantiable),
              "converted": len(rows), "first_party": len(FIRST_PARTY), "generic": len(rows) - len(FIRST_PARTY),
              "excepted": len(with_class - set(rows))}
    text = render(rows, {t: why for t, why in EXCEPTIONS.items()}, counts)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
