"""UBMoE's pieces below the adapter: the bidirectional reading of a decoder, SimCSE's contrastive loss, the two
training stages (the FFN copy tuned contrastively under bidirectional attention; the routers trained on the
language-model loss) and the routing hooks they and ``embed`` use.

Bidirectional attention is a 4-D additive mask handed to the decoder (0 where a query may look, the dtype's
minimum at padding keys): transformers takes a 4-D mask as given, so no causal triangle is added and every token
sees every real token, whatever the attention kernel (eager or SDPA).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from zoo.moe import Routing


# ---- reading a decoder --------------------------------------------------------------------------------------------

def bidirectional_mask(attention_mask, batch: int, length: int, dtype, device) -> torch.Tensor:
    """[B, 1, S, S] additive mask: every query sees every real key (``attention_mask [B, S]``: 1 real, 0 padding)."""
    keep = (torch.ones(batch, length, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask.to(device=device).bool())
    mask = torch.zeros(batch, 1, length, length, dtype=dtype, device=device)
    return mask.masked_fill(~keep[:, None, None, :], torch.finfo(dtype).min)


def decoder_of(model):
    """The decoder stack (``model.model`` of a causal LM), which returns the last hidden states."""
    decoder = getattr(model, "model", None)
    if decoder is None:
        raise TypeError(f"ubmoe reads the decoder of a causal LM (model.model); {type(model).__name__} has none")
    return decoder


def last_hidden(model, input_ids, attention_mask=None, bidirectional: bool = True) -> torch.Tensor:
    """[B, S, H] last hidden states, read with bidirectional (or the model's own causal) attention."""
    decoder = decoder_of(model)
    mask = attention_mask
    if bidirectional:
        dtype = decoder.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(input_ids.device.type):
            dtype = torch.get_autocast_dtype(input_ids.device.type)
        mask = bidirectional_mask(attention_mask, *input_ids.shape, dtype, input_ids.device)
    return decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state


def mean_pool(hidden: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """[B, H] mean of each row's real tokens' hidden states (fp32)."""
    h = hidden.float()
    if attention_mask is None:
        return h.mean(1)
    m = attention_mask.to(h.device, h.dtype)[..., None]
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def simcse_loss(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """Unsupervised SimCSE (InfoNCE): row i of ``a`` must pick row i of ``b`` (the same text under another dropout
    mask) among all rows of ``b`` (in-batch negatives), by cosine similarity over ``temperature``."""
    wide = torch.promote_types(a.dtype, torch.float32)  # at least fp32 (bf16 training)
    a, b = F.normalize(a.to(wide), dim=-1), F.normalize(b.to(wide), dim=-1)
    return F.cross_entropy(a @ b.T / temperature, torch.arange(len(a), device=a.device))


# ---- routing hooks ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _rewritten(routers, rewrite):
    """Within the ``with``: each router's ``Routing`` replaced by ``rewrite(routing)``."""
    handles = [r.register_forward_hook(lambda module, args, out: rewrite(out)) for r in routers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def only_expert(routers, expert: int):
    """Within the ``with``: every token of these top-1 routers goes to ``expert`` with weight 1 (the logits stay)."""
    def rewrite(out):
        return Routing(weights=torch.ones_like(out.weights[:, :1]),
                       indices=torch.full_like(out.indices[:, :1], expert), logits=out.logits)
    return _rewritten(routers, rewrite)


def straight_through(routers):
    """Within the ``with``: the top-1 choice computes exactly as before (the chosen expert, weight 1; the other with
    weight 0), but the weights carry the gradient of the softmax probabilities, ``w_e = [e chosen] + p_e - sg(p_e)``:
    the router gets the gradient of the dense mixture ``sum_e p_e F_e(x)``, ``dL/dl_1 = p_0 p_1 <g, F_1 - F_0>``.
    With renormalised top-1 weights (the authors' configuration) the weight is the constant 1 and the router would
    get no gradient at all from the language-model loss."""
    def rewrite(out):
        chosen = out.indices[:, :1]
        probs = out.logits.float().softmax(-1)
        order = torch.cat([chosen, 1 - chosen], 1)  # the chosen expert first, then the other of the two
        p = probs.gather(1, order)
        hard = torch.zeros_like(p)
        hard[:, 0] = 1.0
        return Routing(weights=(hard + p - p.detach()).to(out.weights.dtype), indices=order, logits=out.logits)
    return _rewritten(routers, rewrite)


# ---- training ------------------------------------------------------------------------------------------------------

def corpus_batches(tokenizer, batch_size: int, seq_len: int, seed: int):
    """``step -> [batch_size, seq_len]`` windows of the shipped corpus' train split, the domains alternating."""
    from zoo.data.corpus import DOMAINS
    from zoo.data.tokens import token_stream, train_batch

    streams = {d: token_stream(d, "train", tokenizer) for d in DOMAINS}
    return lambda step: train_batch(streams, step, batch_size, seq_len, seed)


def given_batches(rows: torch.Tensor, batch_size: int, seed: int):
    """``step -> [batch_size, S]`` rows of ``rows`` drawn without replacement within a step (seeded per step)."""
    def draw(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return rows[torch.randperm(len(rows), generator=g)[:batch_size]]
    return draw


def _optimise(params, steps: int, lr: float, loss_at, desc: str) -> list[float]:
    """AdamW (no weight decay) with the zoo's schedule (10% warm-up, cosine to 10%), clipping at 1; the losses."""
    from zoo.training.finetune import lr_at

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    for step in tqdm(range(steps), desc=desc, leave=False):
        for group in opt.param_groups:
            group["lr"] = lr_at(lr, step, steps)
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@contextlib.contextmanager
def dropout_on(model, p: float):
    """SimCSE's noise on a decoder without dropout modules: dropout ``p`` on the attention probabilities and on every
    FFN's output (where BERT drops the sublayer outputs), for the ``with`` only."""
    layers = decoder_of(model).layers
    saved = [(layer.self_attn, layer.self_attn.attention_dropout) for layer in layers
             if hasattr(layer.self_attn, "attention_dropout")]
    handles = [layer.mlp.register_forward_hook(lambda m, a, out: F.dropout(out, p, training=m.training))
               for layer in layers]
    for attn, _ in saved:
        attn.attention_dropout = p
    try:
        yield
    finally:
        for attn, value in saved:
            attn.attention_dropout = value
        for h in handles:
            h.remove()


@contextlib.contextmanager
def training_only(model, params):
    """``model`` in training mode with only ``params`` requiring a gradient; both restored after."""
    chosen = {id(p) for p in params}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(id(p) in chosen)
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def contrastive_tune(model, params, batches, steps: int, lr: float, temperature: float, dropout: float,
                     seed: int, desc: str = "ubmoe: bidirectional contrastive tuning") -> list[float]:
    """Train ``params`` of ``model`` (every other parameter frozen for the run) with unsupervised SimCSE under
    bidirectional attention: each window of ``batches(step)`` twice in one batch, two dropout masks, mean-pooled,
    the other windows as negatives. Returns the loss per step."""
    def loss_at(step):
        ids = batches(step)
        pooled = mean_pool(last_hidden(model, torch.cat([ids, ids])))
        return simcse_loss(pooled[:len(ids)], pooled[len(ids):], temperature)

    with training_only(model, params):
        torch.manual_seed(seed)  # the dropout masks
        with dropout_on(model, dropout):
            return _optimise(list(params), steps, lr, loss_at, desc)


def train_routers(model, routers, batches, steps: int, lr: float, desc: str = "ubmoe: router training") -> list[float]:
    """The second stage: only ``routers`` train, on the causal language-model loss of ``batches(step)``, through
    ``straight_through``. Returns the loss per step."""
    params = [p for r in routers for p in r.parameters() if p.is_floating_point()]

    def loss_at(step):
        ids = batches(step)
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    with training_only(model, params), straight_through(routers):
        return _optimise(params, steps, lr, loss_at, desc)
