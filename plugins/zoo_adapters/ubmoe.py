"""ubmoe: the Uni-Bi-directional Mixture-of-Experts LLM (Li et al., ICML 2025). Bidirectional fine-tuning makes a
decoder a better text encoder but a worse generator; of its modules the FFN is the one whose tuning shifts the
model's dependence on later tokens least. So each layer keeps its original (unidirectional) FFN as expert 0 and
gets, as expert 1, a copy of it tuned under bidirectional attention with unsupervised contrastive learning
(SimCSE: each text twice under two dropout masks is the positive pair, the batch's other texts the negatives,
mean-pooled last hidden states, temperature 0.05); a new top-1 router per layer picks one of the two FFNs for
every token (weight 1: the authors' 2-expert, top-1, renormalised Qwen2-MoE layer), trained on the
language-model loss while everything else stays frozen. Attention, norms and embeddings are the original's.

``zoo.apply(dense, "ubmoe", ...)`` runs both stages on windows of the zoo corpus' train split (or ``data``, token
id rows) and returns the dense model's MoE sibling (Mistral/Llama -> Mixtral, Qwen2 -> Qwen2-MoE, ...; see
``upcycle.SIBLINGS``) with 2 experts and top-1 routing: an ordinary zoo model that saves, reloads and exports as
the sibling's native format. Generation is its causal forward; ``embed(model, ids, mask)`` reads embeddings the
way the copy was tuned: bidirectional attention, the bidirectional expert in every layer, mean pooling.

A dense model only: the method pairs *the* FFN of a dense LLM with its copy (an MoE's FFN is already a set of
experts behind a router; the paper and its code are about dense Qwen2.5 models). After ``zoo.apply`` only the
routers require a gradient, and ``Ubmoe(...).loss`` is the stage-2 loss, so ``moe-zoo finetune`` (adapter-lab)
continues the router training.

The zoo's choice where the authors' setup gives nothing to learn: a renormalised top-1 weight is the constant 1,
so the language-model loss sends no gradient to the router. Training uses ``ubmoe_train.straight_through``: the
same hard top-1 forward, with the gradient of the dense softmax mixture of the two experts for the router.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from zoo import Adapter
from zoo.components.controls import Control
from zoo.components.options import check_float, check_int, suggest
from zoo.moe.layout import moe_layers
from zoo_adapters.ubmoe_train import (contrastive_tune, corpus_batches, decoder_of, given_batches, last_hidden,
                                      mean_pool, only_expert, straight_through, train_routers)
from zoo_adapters.upcycle import dense_mlps, ffn_weights, to_sibling

UNI, BI = 0, 1  # the expert indices of every UBMoE layer
EXPERTS = ("bi", "uni", "router")  # embed: force the bidirectional or the original FFN, or let the router pick
ATTENTIONS = ("bidirectional", "causal")


def is_ubmoe(model) -> bool:
    """Whether ``model`` came out of ``zoo.apply(..., "ubmoe")`` (its recipe has the step)."""
    recipe = getattr(getattr(model, "config", None), "zoo_recipe", None) or []
    return any(step.get("name") == Ubmoe.name for step in recipe)


def ubmoe_routers(model) -> list:
    """The routers of a UBMoE model's layers (2 experts, top-1 each), or a TypeError saying what is expected."""
    layers = moe_layers(model) if is_ubmoe(model) else []
    if not layers or any(moe.num_experts != 2 or moe.top_k != 1 for _, moe in layers):
        raise TypeError("not a UBMoE model (each layer's FFN and its bidirectional copy behind a top-1 router): "
                        "make one with zoo.apply(dense_model, 'ubmoe')")
    return [moe.router for _, moe in layers]


def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
          attention: str = "bidirectional", expert: str | None = None) -> torch.Tensor:
    """[B, H] text embeddings: the mean of the last hidden states over each row's real tokens (fp32, not normalised;
    compare them by cosine). UBMoE's reading (the defaults on a UBMoE model): bidirectional attention and ``expert=
    "bi"``, the contrastively tuned FFN in every layer, i.e. the model the copy was trained as. ``expert="router"``
    lets the (generation-trained) routers pick, ``"uni"`` forces the original FFN. On another model (the dense
    original, for comparison) ``expert`` must stay None; ``attention="causal"`` reads it as it generates."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}"
                         f"{suggest(str(attention), ATTENTIONS)}")
    if expert is not None and expert not in EXPERTS:
        raise ValueError(f"expert must be one of {EXPERTS}, got {expert!r}{suggest(str(expert), EXPERTS)}")
    if is_ubmoe(model):
        routers, expert = ubmoe_routers(model), expert or "bi"
    elif expert is not None:
        raise ValueError(f"expert={expert!r} picks a UBMoE layer's FFN; this model is no UBMoE model")
    forced = contextlib.nullcontext()
    if expert in ("bi", "uni"):
        forced = only_expert(routers, BI if expert == "bi" else UNI)
    with forced:
        hidden = last_hidden(model, input_ids, attention_mask, bidirectional=attention == "bidirectional")
    return mean_pool(hidden, attention_mask)


class Ubmoe(Adapter):
    name = "ubmoe"
    summary = ("Uni-Bi-directional MoE: each dense FFN beside its copy tuned bidirectionally (SimCSE), a top-1 router "
               "per token between them: embeddings of the bidirectional model, generation of the original.")
    paper = ("Li, Hei, Li, Zhang, Wang, Zhao, Qi & Liu, What Limits Bidirectional Model's Generative Capabilities? "
             "A Uni-Bi-Directional Mixture-of-Expert Method For Bidirectional Fine-tuning, ICML 2025 (PMLR 267: "
             "34564-34577), https://openreview.net/forum?id=kPqvx2mvec")
    card = "cards/ubmoe.md"
    space = "adapter-lab"
    accepts_dense = True  # zoo.apply passes the dense model as it is

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("bi_steps", "int", 10, low=1, high=200, step=1,
                        help="contrastive steps tuning the bidirectional FFN copy"),
                Control("bi_lr", "float", 3e-4, low=1e-5, high=1e-2, step=1e-5, help="learning rate of the copy"),
                Control("temperature", "float", 0.05, low=0.01, high=1.0, step=0.01, help="SimCSE temperature"),
                Control("dropout", "float", 0.1, low=0.0, high=0.5, step=0.05,
                        help="dropout making SimCSE's positive pairs"),
                Control("router_steps", "int", 0, low=0, high=200, step=1,
                        help="router steps inside the step (the lab's fine-tuning then trains the routers too)"),
                Control("router_lr", "float", 1e-3, low=1e-5, high=1e-1, step=1e-4,
                        help="learning rate of the routers")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"bi_steps": 10, "router_steps": 0}, "strong": {"bi_steps": 40, "router_steps": 20}}

    def __init__(self, bi_steps: int = 100, bi_lr: float = 3e-4, temperature: float = 0.05, dropout: float = 0.1,
                 router_steps: int = 100, router_lr: float = 1e-3, batch_size: int = 8, seq_len: int = 64,
                 data: list | None = None, seed: int = 0):
        super().__init__(bi_steps=bi_steps, bi_lr=bi_lr, temperature=temperature, dropout=dropout,
                         router_steps=router_steps, router_lr=router_lr, batch_size=batch_size, seq_len=seq_len,
                         data=data, seed=seed)
        self.bi_steps = check_int("bi_steps", bi_steps, 1)
        self.bi_lr = check_float("bi_lr", bi_lr, 1e-12)
        self.temperature = check_float("temperature", temperature, 1e-6)
        self.dropout = check_float("dropout", dropout, 0.0, 0.9)
        self.router_steps = check_int("router_steps", router_steps, 0)
        self.router_lr = check_float("router_lr", router_lr, 1e-12)
        self.batch_size = check_int("batch_size", batch_size, 2)  # SimCSE needs in-batch negatives
        self.seq_len = check_int("seq_len", seq_len, 2)
        self.seed = check_int("seed", seed, 0, 2**32 - 1)
        self.data = None if data is None else check_rows(data)
        self.results = {}

    def batches(self, model):
        """``step -> [B, S]`` training windows: ``data``'s rows, else the zoo corpus through the model's tokenizer.
        Raises (before anything runs) when ids fall outside the vocabulary or no tokenizer fits."""
        vocab = model.config.get_text_config().vocab_size
        if self.data is not None:
            if int(self.data.max()) >= vocab:
                raise ValueError(f"ubmoe: data holds token id {int(self.data.max())}, outside the model's vocabulary "
                                 f"of {vocab}")
            return given_batches(self.data, min(self.batch_size, len(self.data)), self.seed)
        from zoo.io.loading import tokenizer_for

        try:
            tokenizer = tokenizer_for(model, required=True)
        except ValueError as exc:
            raise ValueError(f"ubmoe trains on the zoo corpus through the model's tokenizer: {exc}; or pass data "
                             "(token id rows)") from None
        return corpus_batches(tokenizer, self.batch_size, self.seq_len, self.seed)

    def attach(self, model):
        mlps = dense_mlps(model, self.name)
        batches = self.batches(model)
        H, std = model.config.hidden_size, model.config.initializer_range
        g = torch.Generator().manual_seed(self.seed)
        rows = [torch.randn(2, H, generator=g) * std for _ in mlps]  # a new gate, as a new MoE layer is initialised

        # stage 1: a float copy of the model, its FFNs tuned with SimCSE under bidirectional attention
        bi = copy.deepcopy(model).float()
        copies = [layer.mlp for layer in decoder_of(bi).layers]
        bi_losses = contrastive_tune(bi, [p for m in copies for p in m.parameters()], batches, self.bi_steps,
                                     self.bi_lr, self.temperature, self.dropout, self.seed)
        blocks = []
        with torch.no_grad():
            for mlp, tuned, router in zip(mlps, copies, rows):
                (gate_up, down), (bi_gate_up, bi_down) = ffn_weights(mlp), ffn_weights(tuned)
                blocks.append((router.to(down.dtype), torch.stack([gate_up, bi_gate_up.to(gate_up.dtype)]),
                               torch.stack([down, bi_down.to(down.dtype)])))
        del bi, copies
        out = to_sibling(model, blocks, 1, 0.0)  # no balance loss: the router is free to keep the original FFN

        # stage 2: the routers alone, on the language-model loss (fp32 while they train)
        routers = [moe.router for _, moe in moe_layers(out)]
        router_losses = []
        if self.router_steps:
            dtypes = [(p, p.dtype) for p in out.parameters()]
            for p, _ in dtypes:
                p.data = p.data.float()
            try:
                router_losses = train_routers(out, routers, batches, self.router_steps, self.router_lr)
            finally:
                for p, dtype in dtypes:
                    p.data = p.data.to(dtype)
        out.requires_grad_(False)
        for router in routers:
            router.requires_grad_(True)
        out.train(model.training)
        self.results = {"bi contrastive loss": [round(bi_losses[0], 4), round(bi_losses[-1], 4)],
                        **({"router lm loss": [round(router_losses[0], 4), round(router_losses[-1], 4)]}
                           if router_losses else {}),
                        "bi expert share": bi_share(out, routers, batches(self.bi_steps + self.router_steps))}
        return out

    def loss(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """The stage-2 loss ``(L_lm, L_lm)``: the causal language-model loss through ``straight_through`` routing
        (``moe-zoo finetune`` trains the routers with it; everything else is frozen by ``attach``)."""
        from zoo.training.finetune import base_of

        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        with straight_through(ubmoe_routers(base_of(model))):
            lm = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
        return lm, lm


def check_rows(data) -> torch.Tensor:
    """``data`` as a [N, S] long tensor: at least 2 rows of at least 2 non-negative token ids, all of one length."""
    ok = isinstance(data, (list, tuple)) and len(data) >= 2 and all(
        isinstance(r, (list, tuple)) and len(r) >= 2 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                             for t in r) for r in data)
    if not ok or len({len(r) for r in data}) != 1:
        raise ValueError("data must be a list of at least 2 rows of token ids (non-negative integers), all of one "
                         "length >= 2")
    return torch.tensor([list(r) for r in data], dtype=torch.long)


@torch.no_grad()
def bi_share(model, routers, ids) -> list[float]:
    """Per layer, the share of ``ids``'s tokens the routers send to the bidirectional expert (causal forward)."""
    picks = []
    handles = [r.register_forward_hook(lambda m, a, out: picks.append(out.indices[:, 0].float().mean().item()))
               for r in routers]
    was_training = model.training
    model.eval()
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [round(p, 4) for p in picks]
