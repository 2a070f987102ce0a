"""roma: Routing Manifold Alignment (Li, Li & Zhou, 2025, arXiv:2511.07419). Post-training of the routers alone:
everything but the routers of the last ``last_layers`` MoE layers is frozen, and they are trained on

    L = L_task + lam * (1/B) sum_i sum_{j in N(i)} W_ij ||r_i - r_j||^2

where ``r_i`` is sample i's routing profile (each tuned layer's softmax over its experts, averaged over the
sample's tokens, layers concatenated) and ``N(i)`` its ``k`` nearest *successful* samples in a task-embedding
space, weighted by a heat kernel on the embedding distance (``roma_manifold``). The task here is next-token
prediction on the zoo's corpus: a sample is a window of text, its task loss the language-model loss, and it is
successful when its next-token accuracy is in the top ``1 - success`` of a pool of ``pool`` windows per domain
drawn from the train split. The pool (embeddings, the routing profiles that led to the successes) is recorded
once, on the first ``loss`` call, before any step: the neighbours' profiles are fixed targets.

``zoo.apply(model, "roma", ...)`` freezes the model but the tuned routers; ``Roma(...).loss(model, input_ids)``
is the training loss ``moe-zoo finetune`` uses. The result is a plain zoo model with retrained routers: it saves,
reloads and exports as before.
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from zoo import Adapter
from zoo.components.controls import Control
from zoo.training.finetune import base_of
from zoo.moe.layout import moe_layers
from zoo.components.options import check_float, check_int
from zoo_adapters.roma_embed import EMBEDDINGS, check_embedding, hidden_embed, texts_of, wordllama_embed
from zoo_adapters.roma_manifold import (Bank, capture_routing, ids_key, manifold_penalty, neighbours,
                                        next_token_accuracy, normalised, routing_profile)

MAX_POOL = 4096
BANKS = "_roma_banks"  # the recorded pools, on the model object (not saved: they serve one training run)


class Roma(Adapter):
    name = "roma"
    summary = ("Routing Manifold Alignment: fine-tune only the routers, pulling each sample's routing toward that "
               "of its successful neighbours in a task-embedding space.")
    paper = ("Li, Li & Zhou, Routing Manifold Alignment Improves Generalization of Mixture-of-Experts LLMs, 2025. "
             "arXiv:2511.07419")
    card = "cards/roma.md"
    space = "adapter-lab"

    def __init__(self, lam: float = 1.0, k: int = 5, bandwidth: float = 1.0, success: float = 0.5,
                 last_layers: int = 5, pool: int = 64, window: int = 128, embedding: str = "wordllama",
                 seed: int = 0):
        super().__init__(lam=lam, k=k, bandwidth=bandwidth, success=success, last_layers=last_layers, pool=pool,
                         window=window, embedding=embedding, seed=seed)
        self.lam = check_float("lam", lam, 0.0)
        self.k = check_int("k", k, 1, MAX_POOL)
        self.bandwidth = check_float("bandwidth", bandwidth, 1e-6)
        self.success = check_float("success", success, 0.0, 1.0)
        self.last_layers = check_int("last_layers", last_layers, 1, 1024)
        self.pool = check_int("pool", pool, 2, MAX_POOL)
        self.window = check_int("window", window, 2, 8192)
        if not isinstance(embedding, str):
            raise ValueError(f"roma: embedding must be one of {', '.join(EMBEDDINGS)}, got {embedding!r}")
        check_embedding(embedding)
        self.embedding = embedding
        self.seed = check_int("seed", seed, 0, 2**32 - 1)
        self._tokenizer = None
        self.last_penalty = None  # the last loss call's regulariser value (detached), for logging

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("lam", "float", 1.0, low=0.0, high=100.0, step=0.5, help="weight of the manifold regulariser"),
                Control("k", "int", 5, low=1, high=16, step=1, help="successful neighbours per sample"),
                Control("success", "float", 0.5, low=0.0, high=0.9, step=0.05,
                        help="share of the pool left out of the successful set (the top 1 - success by accuracy are in)"),
                Control("pool", "int", 16, low=4, high=128, step=4, help="pool windows per domain"),
                Control("embedding", "choice", "wordllama", choices=EMBEDDINGS,
                        help="task embedding: WordLlama sentence embedding, or the model's mean hidden state")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"lam": 1.0, "pool": 16}, "strong": {"lam": 10.0, "pool": 16}}

    def tuned(self, model) -> dict:
        """{layer: SparseMoE} of the last ``last_layers`` MoE layers (all of them when there are fewer)."""
        return dict(moe_layers(model)[-self.last_layers:])

    def attach(self, model):
        blocks = self.tuned(model)
        if not blocks:
            raise TypeError("roma tunes the routers of MoE layers; this model has none")
        if not any(p.is_floating_point() for moe in blocks.values() for p in moe.router.parameters()):
            raise TypeError("roma: the routers of the tuned layers have no trainable parameters")
        model.requires_grad_(False)
        for moe in blocks.values():
            moe.router.requires_grad_(True)
        self.results = {"tuned layers": sorted(blocks),
                        "router parameters": sum(p.numel() for moe in blocks.values() for p in moe.router.parameters())}
        return model

    # ---- the pool of samples the neighbours come from ------------------------------------------------------

    def tokenizer(self, model):
        if self._tokenizer is None:
            from zoo.io.loading import tokenizer_for

            self._tokenizer = tokenizer_for(model, required=True)
        return self._tokenizer

    def corpus_samples(self, model) -> dict:
        """{domain: [pool, window] ids}: windows of each domain's train split, drawn with ``seed``."""
        from zoo.data.corpus import DOMAINS
        from zoo.data.tokens import token_stream

        g = torch.Generator().manual_seed(self.seed)
        samples = {}
        for domain in DOMAINS:
            stream = token_stream(domain, "train", self.tokenizer(model))
            starts = torch.randint(0, len(stream) - self.window, (self.pool,), generator=g).tolist()
            samples[domain] = torch.stack([stream[s:s + self.window] for s in starts]).long()
        return samples

    def bank(self, model, samples: dict | None = None) -> Bank:
        """The pool recorded for these options on ``model``: built on first use from the corpus windows, or from
        ``samples`` ({domain: [N, S] ids}) when given (other data, or a model without the zoo's tokenizer)."""
        model = base_of(model)
        key = (self.last_layers, self.pool, self.window, self.success, self.embedding, self.seed)
        banks = model.__dict__.setdefault(BANKS, {})
        if key not in banks or samples is not None:
            banks[key] = self.build_bank(model, self.corpus_samples(model) if samples is None else samples)
        return banks[key]

    @torch.no_grad()
    def build_bank(self, model, samples: dict, batch_size: int = 8) -> Bank:
        """Run ``samples`` ({domain: [N, S] ids}) through the model as it is: per sample its next-token accuracy,
        routing profile and embedding; the successful ones are those at or above the ``success`` quantile."""
        model = base_of(model)
        blocks = self.tuned(model)
        was_training = model.training
        model.eval()
        emb, prof, acc, keys, domains = [], [], [], [], []
        try:
            rows = [(d, r) for d, ids in samples.items() for r in ids.long().split(batch_size)]
            for domain, ids in tqdm(rows, desc="roma: recording the pool", leave=False):
                with capture_routing(blocks) as probs:
                    out = model(input_ids=ids, output_hidden_states=self.embedding == "hidden")
                prof.append(routing_profile(probs, *ids.shape))
                acc.append(next_token_accuracy(out.logits, ids))
                emb.append(self.embed(model, ids, None, out))
                keys += [ids_key(row) for row in ids]
                domains += [domain] * len(ids)
        finally:
            model.train(was_training)
        accuracy = torch.cat(acc)
        # the top (1 - success) share by accuracy, at least one (ties broken by pool order, not all let in)
        top = max(1, math.ceil((1 - self.success) * len(accuracy) - 1e-9))
        order = torch.sort(accuracy, descending=True, stable=True).indices[:top]
        successful = torch.zeros(len(accuracy), dtype=torch.bool)
        successful[order] = True
        return Bank(torch.cat(emb), torch.cat(prof).float(), accuracy, successful, keys, domains, tuple(blocks),
                    float(accuracy[order].min()))

    def embed(self, model, ids, attention_mask, out) -> torch.Tensor:
        if self.embedding == "hidden":
            return hidden_embed(out.hidden_states[-1], attention_mask)
        return normalised(wordllama_embed(texts_of(ids, self.tokenizer(model), attention_mask)))

    # ---- the training loss -----------------------------------------------------------------------------------

    def loss(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """``(L_task + lam * manifold penalty, L_task)`` for one batch ``[B, S]``; L_task is the LM loss."""
        base = base_of(model)
        bank = self.bank(base)
        blocks = {i: moe for i, moe in self.tuned(base).items() if i in bank.layers}
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        extra = {"output_router_logits": False} if hasattr(base.config, "output_router_logits") else {}
        with capture_routing(blocks) as probs:
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                        output_hidden_states=self.embedding == "hidden", **extra)
        lm = out.loss
        if self.lam == 0:  # plain router-only fine-tuning: the ablation the paper compares with
            self.last_penalty = None
            return lm, lm
        profiles = routing_profile(probs, *input_ids.shape, attention_mask)
        embeddings = self.embed(base, input_ids, attention_mask, out)
        cand_emb, cand_prof, cand_keys = bank.successes()
        rows = input_ids if attention_mask is None else [r[m.bool()] for r, m in zip(input_ids, attention_mask)]
        own = [ids_key(r) for r in rows]
        exclude = torch.tensor([[key == c for c in cand_keys] for key in own], dtype=torch.bool)
        idx, weights = neighbours(embeddings, cand_emb, self.k, self.bandwidth, exclude)
        penalty = manifold_penalty(profiles, cand_prof, idx, weights)
        self.last_penalty = penalty.detach()
        return lm + self.lam * penalty, lm
