"""Train the zoo's own small models on the shipped corpus: an MoE (Mixtral or Qwen3-MoE layout) and a
dense control with the same active parameters (Mistral layout), on the same tokens.

bf16 autocast where the processor multiplies bf16 natively (``zoo.training.precision``), the load-balancing loss
for MoE models, a tqdm bar, periodic validation per domain, and resumable checkpoints (weights and optimizer state in
safetensors, never pickles).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from zoo.io.atomic import atomic_directory, write_text
from zoo.data.corpus import DOMAINS
from zoo.data.tokenizer import load_tokenizer
from zoo.data.tokens import eval_windows, token_stream, train_batch
from zoo.training.precision import training_autocast

ARCHS = ("mixtral", "qwen3_moe", "dense")


@dataclass
class TrainConfig:
    arch: str = "mixtral"  # mixtral | qwen3_moe | dense (Mistral layout)
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    experts_per_tok: int = 2
    expert_intermediate: int = 512
    dense_intermediate: int | None = None  # default: experts_per_tok * expert_intermediate (same active)
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    eval_every: int = 100
    eval_windows: int = 24
    seed: int = 0
    bf16: bool | None = None  # bf16 autocast; None: where bf16 is native (zoo.training.precision)
    threads: int | None = None
    out: str = "runs/zoo-tiny-moe"
    # Start from a trained model instead of random weights: ``init`` is a model zoo.load accepts (a name or a
    # folder), ``init_recipe`` a zoo.apply recipe run on it first (e.g. "upcycle:num_experts=8,top_k=2").
    # The model's own shape wins over the size fields above; ``arch`` must name what the result is.
    init: str | None = None
    init_recipe: str | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.init_recipe and not self.init:
            raise ValueError("init_recipe needs init (the model the recipe is applied to)")
        if self.bf16 is not None and not isinstance(self.bf16, bool):
            raise ValueError(f"bf16 must be true, false or null, got {self.bf16!r}")

    @classmethod
    def from_json(cls, path: str, **overrides) -> "TrainConfig":
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown keys in {path}: {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def build_model(cfg: TrainConfig, tokenizer):
    """A randomly initialised native model of the chosen layout (tied embeddings)."""
    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  max_position_embeddings=max(1024, cfg.seq_len), tie_word_embeddings=True,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    if cfg.arch == "mixtral":
        conf = MixtralConfig(**common, intermediate_size=cfg.expert_intermediate, num_local_experts=cfg.num_experts,
                             num_experts_per_tok=cfg.experts_per_tok, router_aux_loss_coef=cfg.aux_loss_coef)
        return MixtralForCausalLM(conf)
    if cfg.arch == "qwen3_moe":
        conf = Qwen3MoeConfig(**common, intermediate_size=cfg.experts_per_tok * cfg.expert_intermediate,
                              moe_intermediate_size=cfg.expert_intermediate, num_experts=cfg.num_experts,
                              num_experts_per_tok=cfg.experts_per_tok, norm_topk_prob=True,
                              router_aux_loss_coef=cfg.aux_loss_coef, head_dim=cfg.hidden_size // cfg.num_heads)
        return Qwen3MoeForCausalLM(conf)
    inter = cfg.dense_intermediate or cfg.experts_per_tok * cfg.expert_intermediate
    return MistralForCausalLM(MistralConfig(**common, intermediate_size=inter))


def initial_model(cfg: TrainConfig, tokenizer):
    """The model training starts from: random weights of ``cfg``'s shape, or ``cfg.init`` after
    ``cfg.init_recipe``, checked to be the layout ``cfg.arch`` names and to use the zoo's tokenizer."""
    import zoo

    if not cfg.init:
        model = build_model(cfg, tokenizer)
        return zoo.convert(model) if is_moe(cfg) else model  # train the zoo block; export gives the native one
    from zoo.components.options import parse_step

    step = parse_step(cfg.init_recipe) if cfg.init_recipe else None
    model = zoo.load(cfg.init)
    if step:
        model = zoo.apply(model, step[0], **step[1])
    want = {"dense": ("mistral", "llama"), "mixtral": ("zoo_mixtral",), "qwen3_moe": ("zoo_qwen3_moe",)}[cfg.arch]
    if model.config.model_type not in want:
        raise ValueError(f"init {cfg.init!r}" + (f" after {cfg.init_recipe!r}" if cfg.init_recipe else "")
                         + f" is a {model.config.model_type} model; arch {cfg.arch!r} expects {' or '.join(want)}")
    if model.config.vocab_size != len(tokenizer):
        raise ValueError(f"init {cfg.init!r} has {model.config.vocab_size} token ids; the zoo's tokenizer "
                         f"has {len(tokenizer)}")
    if is_moe(cfg):
        model.config.router_aux_loss_coef = cfg.aux_loss_coef  # the loss trained is the one the config says
    return model.float()


def is_moe(cfg: TrainConfig) -> bool:
    return cfg.arch != "dense"


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def validate(model, windows: dict[str, torch.Tensor], bf16: bool | None, batch: int = 8) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) per domain on fixed held-out windows."""
    model.eval()
    out = {}
    for domain, w in windows.items():
        total, count = 0.0, 0
        for i in range(0, len(w), batch):
            ids = w[i:i + batch]
            with training_autocast(bf16):
                loss = model(input_ids=ids, labels=ids).loss
            n = ids.numel() - ids.shape[0]
            total, count = total + loss.float().item() * n, count + n
        out[domain] = total / count
    model.train()
    return out


def save_checkpoint(path: str, model, optimizer, step: int, history: dict, cfg: TrainConfig) -> None:
    with atomic_directory(path) as tmp:
        model.save_pretrained(os.path.join(tmp, "model"))
        tensors, meta = {}, {"param_groups": optimizer.state_dict()["param_groups"]}
        for idx, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                tensors[f"{idx}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
        save_file(tensors, os.path.join(tmp, "optimizer.safetensors"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "history": history, "config": asdict(cfg), **meta}, f)


def load_checkpoint(path: str, optimizer):
    from transformers import AutoModelForCausalLM

    import zoo  # noqa: F401  (zoo model types)

    model = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"))
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    flat = load_file(os.path.join(path, "optimizer.safetensors"))
    per_param: dict[int, dict] = {}
    for key, value in flat.items():
        idx, name = key.split(".", 1)
        per_param.setdefault(int(idx), {})[name] = value
    return model, {"state": per_param, "param_groups": state["param_groups"]}, state


def train(cfg: TrainConfig, resume: bool = True, progress: bool = True) -> dict:
    """Train (or resume) and write ``cfg.out/final`` (native checkpoint + tokenizer + history)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tokenizer = load_tokenizer()
    streams = {d: token_stream(d, "train", tokenizer) for d in DOMAINS}
    val = {d: eval_windows(token_stream(d, "val", tokenizer), cfg.seq_len, cfg.eval_windows) for d in DOMAINS}
    ckpt = os.path.join(cfg.out, "checkpoint")
    history = {"train": [], "val": [], "seconds": 0.0, "tokens": 0}
    start = 0
    opt_state = None
    if resume and os.path.isdir(ckpt):
        model, opt_state, state = load_checkpoint(ckpt, None)
        start, history = state["step"], state["history"]
    else:
        model = initial_model(cfg, tokenizer)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    model.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {cfg.arch}",
               disable=not progress)
    t0 = time.perf_counter()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        ids = train_batch(streams, step, cfg.batch_size, cfg.seq_len, cfg.seed)
        with training_autocast(cfg.bf16):
            out = model(input_ids=ids, labels=ids, output_router_logits=is_moe(cfg))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lm = out.loss.item() - (cfg.aux_loss_coef * out.aux_loss.item() if out.get("aux_loss") is not None else 0)
        history["train"].append([step + 1, round(lm, 4)])
        history["tokens"] += ids.numel()
        bar.set_postfix(loss=f"{lm:.3f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            history["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            v = validate(model, val, cfg.bf16)
            history["val"].append({"step": step + 1, **{d: round(x, 4) for d, x in v.items()}})
            bar.write(f"step {step + 1}: val " + ", ".join(f"{d} {x:.3f}" for d, x in v.items()))
            save_checkpoint(ckpt, model, optimizer, step + 1, history, cfg)
    return finish(cfg, model, tokenizer, history)


def finish(cfg: TrainConfig, model, tokenizer, history: dict) -> dict:
    """Write the native checkpoint (plain transformers loads it), the tokenizer and the history."""
    import zoo

    final = os.path.join(cfg.out, "final")
    model.eval()
    if is_moe(cfg):
        zoo.export(model, final)
    else:
        model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    history["config"] = asdict(cfg)
    write_text(os.path.join(final, "training.json"), json.dumps(history, indent=1), overwrite=True)
    return history
