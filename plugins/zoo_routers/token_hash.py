"""token-hash: Hash Layers routing as DeepSeek-V4 runs it in its first MoE layers.

A fixed table ``tid2eid [vocab_size, k]`` names each token id's k experts; the gate ``weight [E, H]`` only scores
them: the picked scores (softmax, sigmoid or sqrtsoftplus of the gate logits) are renormalised and scaled by
``routed_scaling_factor``. The table is a persistent long buffer, saved with the model: a converted DeepSeek-V4
keeps its own; a router built anew (``zoo.apply(model, "token-hash", vocab_size=...)``, or a load that lacks the
table) gets a fixed balanced hash (``hash_table``).

The token ids come from the routing context of the model call (``zoo.moe.context``); a token without one (id -1,
an image patch) is routed by the gate's own top-k. Experts pruned or merged by a compressor keep the table valid
through ``expert_map [E, table_experts]``: row e is positive where expert e answers for a table id (the identity
until then); a table id no remaining expert answers for leaves its slot empty. The routing carries no logits, so
no balance loss counts a hash layer: its selection is fixed, and DeepSeek-V4's own loss leaves these layers out."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing
from zoo_routers.scored_topk import SCORE_FUNCTIONS, SCORES
from zoo.components.controls import Control, layer_top_k

GOLDEN = (math.sqrt(5) - 1) / 2


MAX_VOCAB = 2**24  # the table holds vocab_size x k ids; real vocabularies are below 2**20
MAX_TABLE_EXPERTS = 2**16  # expert_map is [E, table_experts]; real MoE layers have at most a few hundred experts

def hash_table(vocab_size: int, top_k: int, num_experts: int) -> torch.Tensor:
    """``[vocab_size, top_k]`` long: slot j of token t is ``(h(t) + j) mod num_experts``, k distinct experts per
    token. ``h(t) = t * a mod vocab_size`` with ``a`` the integer nearest ``vocab_size`` times the golden ratio
    that is coprime to it: a bijection of the vocabulary that scatters neighbouring ids, so every expert gets the
    same number of tokens in each slot (within one)."""
    a = max(1, round(vocab_size * GOLDEN))
    while math.gcd(a, vocab_size) != 1:
        a += 1
    h = torch.arange(vocab_size, dtype=torch.long) * a % vocab_size
    return (h[:, None] + torch.arange(top_k, dtype=torch.long)) % num_experts


class TokenHash(Router):
    name = "token-hash"
    summary = ("Hash Layers: a fixed token-id -> experts table picks each token's k experts; the gate only weights "
               "them (DeepSeek-V4's first MoE layers).")
    paper = ("Roller et al., Hash Layers For Large Sparse Models, NeurIPS 2021, arXiv:2106.04426; DeepSeek-AI, "
             "DeepSeek-V4, 2026 (hash routing with a scoring gate)")
    card = "cards/token-hash.md"
    space = "router-explorer"
    uses_context = True

    @classmethod
    def demo_controls(cls, model=None):  # vocab_size and table_experts are facts of the model: zoo.apply fills them
        return [*super().demo_controls(model)[:1],
                Control("score", "choice", "softmax", choices=SCORES, help="how the gate scores the picked experts"),
                Control("norm_topk_prob", "bool", True, help="renormalise the picked scores"),
                Control("routed_scaling_factor", "float", 1.0, low=0.1, high=4.0, step=0.1,
                        help="scale of the routed output")]

    @classmethod
    def demo_presets(cls, model=None):
        k = layer_top_k(model) or 2
        return {"mild": {"top_k": k}, "strong": {"top_k": 1, "score": "sigmoid"}}

    def __init__(self, hidden_size, num_experts, top_k, vocab_size: int, score: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, table_experts: int | None = None,
                 **options):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size must be an integer in [1, {MAX_VOCAB}] (the model's vocabulary: zoo.apply "
                             f"fills it in), got {vocab_size!r}")
        if isinstance(routed_scaling_factor, bool) or not routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, got {routed_scaling_factor!r}")
        table_experts = num_experts if table_experts is None else table_experts
        if isinstance(table_experts, bool) or not isinstance(table_experts, int) or \
                not top_k <= table_experts <= MAX_TABLE_EXPERTS:
            raise ValueError(f"table_experts (the expert ids the table holds) must be an integer in [top_k={top_k}, "
                             f"{MAX_TABLE_EXPERTS}], got {table_experts!r}")
        super().__init__(hidden_size, num_experts, top_k, vocab_size=vocab_size, score=score,
                         norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=float(routed_scaling_factor),
                         table_experts=table_experts, **options)
        self.vocab_size, self.score, self.norm_topk_prob = vocab_size, score, bool(norm_topk_prob)
        self.routed_scaling_factor, self.table_experts = float(routed_scaling_factor), table_experts
        self.tid2eid = nn.Buffer(hash_table(vocab_size, top_k, table_experts), persistent=True)
        self.expert_map = nn.Buffer(torch.eye(num_experts, table_experts), persistent=True)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        init.copy_(self.tid2eid, hash_table(self.vocab_size, self.top_k, self.table_experts))
        init.eye_(self.expert_map)

    def expert_slots(self) -> torch.Tensor:
        """``[table_experts]``: the expert that answers for each table id, or E where none does."""
        strength, owner = self.expert_map.max(0)
        return torch.where(strength > 0, owner, self.num_experts)

    def scored_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The gate logits in at least fp32 (bf16 models score in fp32, as DeepSeek-V4 does; fp64 stays fp64)."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(hidden.to(dtype), self.weight.to(dtype), bias)

    def forward(self, hidden: torch.Tensor, context=None) -> Routing:
        if context is None or context.input_ids is None:
            raise ValueError("token-hash routes each token by its id: it needs the input ids of the model call "
                             "(the routing context), and this call has none (call the model with input_ids, not "
                             "inputs_embeds, or run the block inside `with routing_context(...)`)")
        ids = context.rows("input_ids", hidden.shape[0]).to(self.tid2eid.device)
        logits = self.scored_logits(hidden)
        scores = SCORE_FUNCTIONS[self.score](logits)
        indices = self.expert_slots()[self.tid2eid[ids.clamp_min(0)]]
        # a token without an id (-1: an image patch) has no table row: the gate's own top-k routes it
        indices = torch.where((ids < 0)[:, None], scores.topk(self.top_k, dim=-1).indices, indices)
        empty = indices >= self.num_experts
        weights = scores.gather(1, indices.masked_fill(empty, 0)).masked_fill(empty, 0)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        # no logits: a balance loss has no selection to balance here (DeepSeek-V4 records none for its hash layers)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=None)

    def reference(self, hidden: torch.Tensor, context=None) -> Routing:
        """``forward`` one token at a time, plainly (what ``zoo.testing.check_component`` compares it with)."""
        ids, slots = context.rows("input_ids", hidden.shape[0]).tolist(), self.expert_slots().tolist()
        weights, indices = [], []
        for h, token in zip(hidden, ids):
            scores = SCORE_FUNCTIONS[self.score](self.scored_logits(h[None])[0])
            picked = scores.topk(self.top_k).indices.tolist() if token < 0 else \
                [slots[e] for e in self.tid2eid[token].tolist()]
            w = torch.stack([scores[e] if e < self.num_experts else scores.new_zeros(()) for e in picked])
            w = w / (w.sum() + 1e-20) if self.norm_topk_prob else w
            weights.append(w * self.routed_scaling_factor)
            indices.append(picked)
        return Routing(weights=torch.stack(weights).to(hidden.dtype), indices=torch.tensor(indices), logits=None)
