"""Fine-tune a model with any registered adapter on one domain of the shipped corpus (``moe-zoo finetune``).

``zoo.apply`` attaches the adapter; then exactly the parameters that still require a gradient are trained (a LoRA
adapter freezes the base, a structural one like upcycle may train everything) on random windows of the domain's
*train* split, with the load-balancing loss when the model has MoE layers. Held-out perplexity per domain (the
``zoo.evaluation.eval`` harness) is measured before and after. An adapter class that defines ``train_step(model)`` has it
called after every optimizer step (on an instance built with the same options), and ``merge(model)`` on request.
A router that defines ``train_loss()`` and ``trainable_parameters()`` (``otp``) is trained the same way: applied
with its options, everything but its ``trainable_parameters`` frozen, and the mean of its layers' ``train_loss()``
added to the language-model loss; the result is a plain zoo model with the trained router.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from zoo.io.atomic import atomic_directory, check_target
from zoo.data.corpus import DOMAINS
from zoo.data.tokens import token_stream, train_batch
from zoo.evaluation.eval import check_positions, perplexity_and_usage
from zoo.io.loading import copy_side_files, tokenizer_for
from zoo.io.outputs import check_output_apart
from zoo.components.options import check_int
from zoo.io.adapter_folder import portable_base
from zoo.moe.layout import moe_layers
from zoo.training.precision import training_autocast, use_bf16


@dataclass
class FinetuneResult:
    model: object
    before: dict  # {"perplexity": {domain: ppl}, "usage": {domain: [per layer]}}
    after: dict
    history: list = field(default_factory=list)  # [step, language-model loss]
    trainable_params: int = 0
    seconds: float = 0.0
    windows: int = 0  # held-out windows per domain, of seq_len tokens
    seq_len: int = 0

    def table(self) -> str:
        """Held-out perplexity per domain, before and after (the window count and length say what it measured:
        perplexity over other windows, e.g. ``moe-zoo eval``'s, is not comparable)."""
        lines = [f"held-out perplexity ({self.windows} windows of {self.seq_len} tokens per domain)",
                 f"{'domain':10}{'before':>10}{'after':>10}{'change':>10}"]
        for d in DOMAINS:
            b, a = self.before["perplexity"][d], self.after["perplexity"][d]
            lines.append(f"{d:10}{b:10.2f}{a:10.2f}{100 * (a / b - 1):+9.1f}%")
        return "\n".join(lines)


def base_of(model):
    """The model the zoo's layer helpers understand (a PEFT wrapper's base still runs the adapter layers)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def held_out(model, tokenizer, seq_len: int, windows: int) -> dict:
    ppl, usage = perplexity_and_usage(base_of(model), tokenizer, seq_len, windows)
    return {"perplexity": {d: round(v, 3) for d, v in ppl.items()}, "usage": usage}


def lr_at(lr: float, step: int, steps: int) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of ``lr``."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def finetune(model, adapter: str, options: dict | None = None, domain: str = "code", steps: int = 100,
             lr: float = 1e-3, batch_size: int = 8, seq_len: int = 256, windows: int = 24, seed: int = 0,
             bf16: bool | None = None, threads: int | None = None, out: str | None = None, merge: bool = False,
             progress: bool = True) -> FinetuneResult:
    """Attach ``adapter`` (with ``options``) to ``model`` (a loaded model, or a name / folder for ``zoo.load``),
    train it for ``steps`` on ``domain``'s training split, and save to ``out`` (atomically) when given. ``bf16``:
    bf16 autocast over the fp32 weights (None: where the processor multiplies bf16 natively)."""
    import zoo
    from zoo.editing.apply import find

    options = dict(options or {})
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    reg = find(adapter)
    # a router that declares ``train_loss`` (otp's learned pruner) trains too: its ``trainable_parameters`` only
    trains_router = reg.kind == "router" and callable(getattr(reg.obj, "train_loss", None))
    if reg.kind != "adapter" and not trains_router:
        raise ValueError(f"{adapter!r} is a {reg.kind}, not an adapter"
                         + (" (nor a router with a train_loss)" if reg.kind == "router" else ""))
    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1), ("seq_len", seq_len, 2),
                             ("windows", windows, 1)):
        check_int(name, value, low)
    if threads is not None:
        check_int("threads", threads, 1)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    check_int("seed", seed, 0, 2**32 - 1)
    if bf16 is not None and not isinstance(bf16, bool):
        raise ValueError(f"bf16 must be True, False or None, got {bf16!r}")
    if out is not None:
        check_target(out)
        check_output_apart(out, model, what="out")  # never into the base (or inside it): it would change the base
    if threads:
        torch.set_num_threads(threads)
    source = model if isinstance(model, (str, os.PathLike)) else None
    if source is not None:
        model = zoo.load(source, dtype=torch.float32)  # fp32 master weights; bf16 autocast for the steps
    check_positions(base_of(model), seq_len, f"seq_len {seq_len}")  # before any perplexity or training
    tokenizer = tokenizer_for(base_of(model), required=True)  # the model's own, checked to fit its vocabulary
    before = held_out(model, tokenizer, seq_len, windows)

    torch.manual_seed(seed)  # the adapter's own initialisation (e.g. LoRA's A) is reproducible
    model = zoo.apply(model, adapter, **options)
    # an adapter may own its training loss (mixture-of-loras with remix: the RLOO policy-gradient loss that
    # trains its non-differentiable router) and a per-step update (ewa's averaging)
    helper = None
    routers = []
    if trains_router:
        routers = [m for m in base_of(model).modules() if isinstance(m, reg.obj)]
        model.requires_grad_(False)
        for router in routers:
            for p in router.trainable_parameters():
                p.requires_grad_(True)
    elif reg.obj.train_step is not None or reg.obj.loss is not None:
        helper = reg.obj(**options)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{adapter} left no parameter to train")
    stepped = [moe.router for _, moe in moe_layers(base_of(model))
               if callable(getattr(moe.router, "after_step", None))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    aux = bool(moe_layers(base_of(model)))
    text = model.config.get_text_config()
    coef = next((getattr(text, k) for k in ("router_aux_loss_coef", "aux_loss_coef")  # JetMoE's: aux_loss_coef
                 if getattr(text, k, None) is not None), 0.0) if aux else 0.0
    stream = token_stream(domain, "train", tokenizer)
    streams = {d: stream for d in DOMAINS}  # train_batch alternates domains; here every row is ``domain``
    history, t0 = [], time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc=f"finetune {adapter} on {domain}", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(lr, step, steps)
        ids = train_batch(streams, step, batch_size, seq_len, seed)
        with training_autocast(bf16):
            if helper is not None and helper.loss is not None:
                loss, lm_loss = helper.loss(model, ids)
            else:
                result = model(input_ids=ids, labels=ids, **({"output_router_logits": True} if aux else {}))
                loss, lm_loss = result.loss, None
                extra = [r.train_loss() for r in routers]
                extra = [e for e in extra if e is not None]
                if extra:  # the routers' own objective (otp: sparsity x mean keep probability), averaged
                    loss = loss + torch.stack(extra).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for router in stepped:  # per-step router updates outside backprop (sigmoid-bias: DeepSeek-V3's bias rule)
            router.after_step()
        if helper is not None and helper.train_step is not None:
            helper.train_step(model)
        if lm_loss is not None:
            lm = lm_loss.item()
        else:
            aux_loss = result.get("aux_loss")
            lm = result.loss.item() - (coef * aux_loss.item() if aux_loss is not None else 0.0)
        history.append([step + 1, round(lm, 4)])
        bar.set_postfix(loss=f"{lm:.3f}")
    seconds = time.perf_counter() - t0
    model.eval()
    if merge:
        model = reg.obj(**options).merge(model) if reg.obj.merge is not None else model
    after = held_out(model, tokenizer, seq_len, windows)
    result = FinetuneResult(model, before, after, history, sum(p.numel() for p in params), seconds, windows, seq_len)
    if out:
        save(result, out, tokenizer, {"base": portable_base(source), "adapter": adapter,
                                      "options": options, "domain": domain, "steps": steps, "lr": lr,
                                      "batch_size": batch_size, "seq_len": seq_len, "seed": seed,
                                      "bf16": use_bf16(bf16), "windows": windows, "merged": merge})
    return result


def save(result: FinetuneResult, out: str, tokenizer, args: dict) -> None:
    """The model (a PEFT adapter folder, or a whole model) with the zoo's card, the base model's tokenizer files and
    generation config, and ``finetune.json``, all or nothing. An adapter names its base portably (a registry name,
    a hub id or an absolute folder: ``zoo.load(out)`` finds it from anywhere)."""
    import zoo

    model = result.model
    peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    with atomic_directory(out) as tmp:
        if peft:
            source = args["base"] or base_of(model).config.name_or_path or None
            model.peft_config[model.active_adapter].base_model_name_or_path = source
            # the vocabulary was not resized: PEFT's "auto" would reload the base config only to compare sizes
            model.save_pretrained(tmp, save_embedding_layers=False)
        else:
            model.save_pretrained(tmp)
        if not copy_side_files(base_of(model).config.name_or_path, tmp):
            tokenizer.save_pretrained(tmp)
        summary = (f"`{args['adapter']}` fine-tuned for {args['steps']} steps on the {args['domain']} training split "
                   f"of the zoo's corpus (held-out perplexity: {args['windows']} windows of {args['seq_len']} "
                   "tokens per domain, before and after in finetune.json).")
        zoo.card(model, eval_result={"perplexity": result.after["perplexity"]}, path=out,
                 summary=summary).save(os.path.join(tmp, "README.md"))
        record = {**args, "trainable_params": result.trainable_params, "seconds": round(result.seconds, 1),
                  "perplexity": {"before": result.before["perplexity"], "after": result.after["perplexity"]},
                  "history": result.history}
        with open(os.path.join(tmp, "finetune.json"), "w") as f:
            json.dump(record, f, indent=1)
