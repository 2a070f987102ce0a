"""zoo.editing.stream: convert, apply, evaluate and export checkpoints larger than memory, one decoder layer at a time
straight from their safetensors shards.

The layer work is ``zoo.editing.layerwise``'s, the same code ``zoo.apply`` runs on a model in memory, so both paths
write the same tensors. Peak memory is about one decoder layer (in, and out) plus the embeddings, the LM head
and the calibration hidden states.
"""
from __future__ import annotations

import math
import os

import torch
from tqdm.auto import tqdm

from zoo.io import loading, outputs
from zoo.editing import distributed
from zoo.architectures import remote_code
from zoo.io.atomic import atomic_directory
from zoo.io.checkpoint import Checkpoint, checkpoint_bytes
from zoo.editing import device as devices
from zoo.editing.layerwise import calibration_inputs, capture_inputs, check, compress_linears, outer_linears, run, \
    set_module, to_device, to_host
from zoo.moe.layout import get_block, layer_block_attr, layer_prefix, put_block
from zoo.moe import SparseMoE
from zoo.io.memory import memory_budget
from zoo.io.shards import ShardWriter

IN_MEMORY_FACTOR = 3  # peak RSS of the in-memory path, in checkpoint sizes (benchmarks/scale.py: 2.0-2.8x)
SIDE_FILES = loading.SIDE_FILES  # tokenizer, generation config, chat template, processor: they travel with saves


# ---- when to stream ------------------------------------------------------------------------------------------
def should_stream(src, max_memory=None) -> bool:
    """Whether ``src`` (a local safetensors folder) is too large to work on in memory within the budget."""
    path = resolve(src)
    if not os.path.isdir(path):
        return False
    try:
        size = checkpoint_bytes(path)
    except ValueError:
        return False
    return size * IN_MEMORY_FACTOR > memory_budget(max_memory)


def resolve(src) -> str:
    """A registry name of a shipped model, or a folder, as a folder path."""
    from zoo.io.loading import resolve_path

    return resolve_path(os.fspath(src))


# ---- reading -----------------------------------------------------------------------------------------------
def open_checkpoint(src) -> Checkpoint:
    """The checkpoint at ``src``, its skeleton converted (on the meta device) to zoo blocks."""
    import zoo

    ckpt = Checkpoint(resolve(src))
    zoo.convert(ckpt.model)
    return ckpt


class Streamed:
    """Layers read from a checkpoint; each finished layer goes to ``write(i, layer)`` and back to meta. With a
    ``device``, a layer is moved there once read and back to the CPU before it is written."""

    def __init__(self, ckpt: Checkpoint, write=None, device=None):
        self.ckpt, self.model, self.layers, self.write = ckpt, ckpt.model, ckpt.layers, write
        self.device = device

    def load_layer(self, i):
        return to_device(self.ckpt.load_layer(i), self.device)

    def replaced(self, i, layer, block):
        put_block(layer, block)  # the old block is not needed again: free it before the next step runs

    def keep_linears(self, i, layer, modules: dict):
        for path, module in modules.items():
            set_module(layer, path, module)

    def keep(self, i, layer, block):
        put_block(layer, block)
        to_host(layer, self.device)
        if self.write is not None:
            self.write(i, layer)

    def release(self, i):
        self.ckpt.release(i)


def layer_tensors(prefix: str, layer) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors under its state-dict prefix (``model.layers.3.``, DBRX's ``transformer.blocks.3.``)."""
    return {f"{prefix}{k}": v for k, v in layer.state_dict().items()}


def outer_tensors(ckpt) -> dict[str, torch.Tensor]:
    """Everything of the checkpoint's model outside its decoder layers (a vision tower included), tied weights once."""
    seen, out = set(), {}
    for k, v in ckpt.model.state_dict().items():
        if ckpt.layer_of(k) is not None or v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v
    return out


def copy_side_files(src: str, dest: str) -> list[str]:
    """``src``'s tokenizer, generation config, chat template and processor files into ``dest`` (a staging folder)."""
    return loading.copy_side_files(src, dest)


def save(model, out, src=None) -> str:
    """``model.save_pretrained(out)`` with the source's tokenizer, generation config, chat template and processor
    files beside it, in one atomic save (``src``: the folder, registry name or cached hub id the model came from;
    by default ``config.name_or_path``). The model's own generation config wins over the source's."""
    source = src if src is not None else getattr(model.config, "name_or_path", "")
    outputs.check_output_apart(out, source, what="out")
    if distributed.is_writer():  # under a process group every rank holds the same model: rank 0 saves it
        with atomic_directory(out) as tmp:
            copy_side_files(source, tmp)
            model.save_pretrained(tmp)
    distributed.barrier()
    return os.fspath(out)


# ---- the commands ------------------------------------------------------------------------------------------
def bind_steps(steps) -> list:
    """``[(name, options), ...]`` as per-layer step objects, every option checked first."""
    from zoo.editing.apply import RouterSwap, find
    from zoo.components.options import check_options

    bound = []
    for name, options in steps:
        reg = find(name)
        if reg.kind == "router":
            bound.append(RouterSwap(reg.obj, options))
        elif reg.kind == "compressor":
            check_options(reg.obj, options)
            component = reg.obj(**options)
            if not component.layerwise:
                raise ValueError(f"compressor {name!r} works on whole models in memory only (it has no "
                                 "compress_layer); run it with --no-stream")
            if getattr(component, "plan_needs_model", False):
                raise ValueError(f"{name} with these options scores its plan on the whole model in memory (allocation="
                                 "'search'); run it with --no-stream, or stream with allocation='error'")
            bound.append(component)
        else:
            check_options(reg.obj, options)
            raise ValueError(f"adapter {name!r} trains or wraps the whole model: it runs in memory (--no-stream)")
    return bound


def apply(src, steps, out, calibration=None, device=None) -> str:
    """``zoo.apply`` of each step in order, layer by layer from ``src``'s shards, written to ``out``.

    ``steps``: ``[(name, options), ...]``. Every option and every layer's precondition is checked before
    anything is computed; ``out`` is written atomically (nothing of it exists until it is complete). ``device``
    (e.g. ``"cuda"``): each layer is calibrated and compressed there (``zoo.editing.device``); None: on the CPU."""
    device = devices.resolve(device)
    outputs.check_output_apart(out, src, what="out")
    ckpt = open_checkpoint(src)
    model = ckpt.model
    components = bind_steps(steps)
    check(model, components)
    moe = [i for i, layer in enumerate(ckpt.layers) if isinstance(get_block(layer), (SparseMoE, ckpt.family.block_class))]
    for component in components:
        component.check_layers(moe)
    inputs = calibration_inputs(model, components, calibration)
    _write(ckpt, out, components, inputs, desc="apply", device=device,
           record=[(name, c.kind, opts, calibration if c.inputs_for else None, c)  # None: the default, if it calibrates
                   for (name, opts), c in zip(steps, components)])
    return os.fspath(out)


def convert(src, out, device=None) -> str:
    """``zoo.convert`` + ``save_pretrained``, layer by layer: a native checkpoint becomes ``zoo_<family>``.
    ``device`` is checked like ``apply``'s; converting computes nothing, so the layers stay on the CPU."""
    devices.resolve(device)
    outputs.check_output_apart(out, src, what="out")
    _write(open_checkpoint(src), out, [], None, desc="convert")
    return os.fspath(out)


def _write(ckpt, out, components, inputs, desc, record=(), device=None):
    from zoo.editing.apply import record_step
    from zoo.publishing.cards import card
    from zoo.moe.layout import sync_layout

    model = ckpt.model
    if not distributed.is_writer():  # another rank of a process group: calibrate its share, write nothing
        ckpt.release_outer()
        run(Streamed(ckpt, lambda i, layer: None, device), components, inputs, desc=desc)
        distributed.barrier()  # return once rank 0's folder is complete
        return
    with atomic_directory(out) as tmp:
        writer = ShardWriter(tmp)
        for path, module in compress_linears(components, model, outer_linears(model)).items():
            set_module(model, path, module)  # the LM head, for a step that targets linears
        writer.write(outer_tensors(ckpt))  # embeddings and LM head in a shard of their own
        ckpt.release_outer()  # the calibration inputs are captured: nothing runs them again
        run(Streamed(ckpt, lambda i, layer: writer.write(layer_tensors(layer_prefix(model, i), layer)), device),
            components, inputs, desc=desc)
        writer.close()
        for step in record:
            record_step(model, *step)
        sync_layout(model)
        remote_code.write(model.config, tmp)  # auto_map: any transformers process opens the folder
        model.config.save_pretrained(tmp)
        copy_side_files(ckpt.path, tmp)
        card(model, path=out).save(os.path.join(tmp, "README.md"))
    distributed.barrier()


def export(src, out) -> str:
    """``zoo.export`` layer by layer: the family's native checkpoint (legacy key names as transformers writes
    them, so vLLM and TGI read it), or ``NotExportable`` with the reason before anything is written."""
    from transformers.core_model_loading import revert_weight_conversion

    from zoo.architectures.native import native_block_state, native_config

    outputs.check_output_apart(out, src, what="out")
    ckpt = open_checkpoint(src)
    model, fam = ckpt.model, ckpt.family
    native_cfg = native_config(model)
    with torch.device("meta"):
        native = fam.model_class(native_cfg)  # what transformers' key-name reversal is read off

    count = max(get_block(layer).num_experts for layer in ckpt.layers if isinstance(get_block(layer), SparseMoE))

    def write(i, layer):
        block, attr = get_block(layer), layer_block_attr(layer)
        moe = isinstance(block, SparseMoE)
        state = {k: v for k, v in layer.state_dict().items() if not (moe and k.startswith(f"{attr}."))}
        if moe:  # under the block's attribute, or the layer itself where the family keeps them there (Gemma 4)
            at = "" if getattr(fam, "native_in_layer", False) else f"{attr}."
            state.update({f"{at}{k}": v for k, v in native_block_state(fam, block, count).items()})
        prefix = layer_prefix(model, i)
        writer.write(revert_weight_conversion(native, {f"{prefix}{k}": v for k, v in state.items()}))

    with atomic_directory(out) as tmp:
        writer = ShardWriter(tmp)
        writer.write(revert_weight_conversion(native, outer_tensors(ckpt)))
        ckpt.release_outer()
        run(Streamed(ckpt, write), [], None, desc="export")
        writer.close()
        native_cfg.save_pretrained(tmp)
        copy_side_files(ckpt.path, tmp)
    return os.fspath(out)


@torch.no_grad()
def evaluate(src, seq_len: int = 256, max_windows: int = 24, batch: int = 8, ood: bool = True, device=None) -> dict:
    """Perplexity per domain (held-out and, with ``ood``, out-of-domain) and expert usage (``zoo.evaluation.eval.evaluate``'s
    numbers, without speed), every window carried through each layer together so each layer's weights are read
    once. ``device``: the layers run there, one at a time, with the windows' hidden states (the head on the CPU)."""
    from zoo.data.corpus import DOMAINS
    from zoo.data.tokens import eval_windows
    from zoo.evaluation.eval import entropy_bits, sizes
    from zoo.data.tokens import token_stream
    from zoo.io.loading import tokenizer_for

    from zoo.editing.head import check_head, final_norm, head_logits, output_head

    device = devices.resolve(device)
    ckpt = open_checkpoint(src)
    model = ckpt.model
    check_head(model)  # before any work: the family's forward must end in a final norm and the LM head
    tok = tokenizer_for(model, required=True)
    batches, domains = [], []  # domains: (domain, split) of each batch
    for split in ("val", "ood") if ood else ("val",):
        for d in DOMAINS:
            windows = eval_windows(token_stream(d, split, tok), seq_len, max_windows)
            for i in range(0, len(windows), batch):
                batches.append(windows[i:i + batch])
                domains.append((d, split))
    inputs = capture_inputs(model, batches)
    inputs = inputs if device is None else inputs.to(device)
    ckpt.release_outer(keep=(output_head(model), final_norm(model)))  # the input embeddings have done their part
    usage = {d: [] for d in DOMAINS}
    for i in tqdm(range(len(ckpt.layers)), desc="eval: layers", leave=False):
        layer = to_device(ckpt.load_layer(i), device)
        calls = []
        handle = None
        block = get_block(layer)
        if isinstance(block, SparseMoE):
            n = block.num_experts

            def count(router, args, routing, n=n):
                idx = routing.indices.reshape(-1)
                calls.append(torch.bincount(idx[idx < n], minlength=n).cpu())
            handle = block.router.register_forward_hook(count)
        try:
            inputs = inputs.advance(i, layer)
        finally:
            if handle is not None:
                handle.remove()
            ckpt.release(i)
        if calls:
            for d in DOMAINS:
                c = sum(c for c, dom in zip(calls, domains) if dom == (d, "val"))
                usage[d].append({"layer": i, "counts": c.tolist(), "entropy_bits": round(entropy_bits(c), 4),
                                 "max_entropy_bits": round(math.log2(len(c)), 4)})
    inputs = inputs if device is None else inputs.to("cpu")  # the head stayed on the CPU
    totals = {d: [0.0, 0.0] for d in set(domains)}
    for h, ids, d in zip(inputs.hidden, batches, domains):
        logits = head_logits(model, h)
        loss = model.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size).float().item()
        n = ids.numel() - ids.shape[0]
        totals[d][0] += loss * n
        totals[d][1] += n
    ppl = {split: {d: round(math.exp(totals[d, split][0] / totals[d, split][1]), 3) for d in DOMAINS
                   if (d, split) in totals} for split in ("val", "ood")}
    result = {"perplexity": ppl["val"], "usage": usage, "size": sizes(model)}
    return {**result, "perplexity_ood": ppl["ood"]} if ood else result
