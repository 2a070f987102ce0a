"""Experts that read only part of each expert's weights per token: channel selection for MoE decoding.

For every (token, routed expert) a *selector* decides, before the expert's weights are read, which channels
the token needs; only those parts of the weight matrices are then read and multiplied. ``budget`` b is the
fraction of each weight matrix a token reads, so the expert bytes read per token are at most b of the
expert's weight bytes, plus the selector's own small read (its sketch). Selectors:

``sketch`` (default; the weight-only reader of "Channel Selection for MoE Decoding Needs No Calibration Data"):
    each expert carries a sketch of its weights, made from the weights alone: the gate and up matrices
    ternarised (a code in {-1, 0, +1} per weight, 2 bits, packed four to a byte, with one scale per row),
    the norms of the down projection's columns, and a rank-r factorisation of the down projection. A token
    first runs the sketch: estimated gate and up pre-activations, hence an estimate h~ of every intermediate
    activation, and scores each intermediate channel i by |h~_i| * ||W_down[:, i]||. The top k = b * I
    channels are then read exactly: rows i of gate and of up, column i of down. The skipped channels'
    contribution is recovered through the low-rank map: W_down ~= A B, and the output gains A (B h~_skipped).
``wina`` (WINA, Chen et al. 2025, as the paper defines it for a gated FFN): every weight matrix's *input* is
    sparsified by |input_j| * ||W[:, j]|| (the matrix's column norm): the hidden input of gate (with gate's
    column norms) and of up (with up's), keeping b * H of its entries, so b of those columns are read; then the
    intermediate activation h, input of down, keeping b * I of them by |h_i| * ||W_down[:, i]||.
``down`` (the zoo's earlier variant, kept as an option): gate and up are read whole, the exact h is scored by
    |h_i| * ||W_down[:, i]|| and only the top b * I columns of down are read. Its read is 2/3 + b/3 of the
    expert's bytes, not b.

``rule``: ``topk`` (the paper's: a fixed count per token, so the read is exactly the budget) or ``threshold``
(the baseline its claim is measured against: a score threshold per expert and matrix, calibrated on data so
that on the calibration tokens the average fraction kept is the budget; the count then varies per token).

``forward`` gathers the selected rows and columns for a few tokens per expert (decode), and for many tokens
(prefill, where their union covers most of the weights anyway) computes the same function with masks over
whole matrices. ``reference`` runs one (token, expert) pair at a time through a byte-counting reader that
gathers exactly the rows and columns the selection names, and is what ``zoo.testing`` compares ``forward``
with; ``counter`` (a ``ReadCounter``) counts the bytes either path reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import initialization as init

from zoo.moe.cpu_precision import linear
from zoo.moe.dispatch import run_sorted
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.init import refuse_missing

SELECTORS = ("sketch", "wina", "down")
RULES = ("topk", "threshold")
DEFAULT_RANK = 8  # the sketch's low-rank recovery map of W_down
GATHER_TOKENS = 8  # at most this many tokens for one expert: gather the selected rows (decode); more: masks
THRESHOLD_SLOTS = ("gate", "up", "down")  # the thresholds' columns: the matrices whose inputs are selected


def channels_for(budget: float, size: int) -> int:
    """The channels a top-k selection keeps out of ``size`` at ``budget``: floor(b * size), at least one (so a
    token never reads more than the budget, except the one channel a tiny budget still needs)."""
    return max(1, int(math.floor(budget * size + 1e-9)))


def check_options(budget, selector, rule, rank) -> int:
    """Validate the options (one clear error each); returns the resolved rank."""
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= 1:
        raise ValueError(f"budget (fraction of each expert's weights a token reads) must be in (0, 1], got {budget!r}")
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"rank (of the sketch's low-rank recovery map; 0: no recovery) must be an integer >= 0, "
                         f"got {rank!r}")
    if selector != "sketch":
        if rank not in (None, 0):
            raise ValueError(f"rank={rank} is the sketch selector's recovery map; selector={selector!r} has none")
        return 0
    return DEFAULT_RANK if rank is None else rank


def ternarize(w: torch.Tensor):
    """Ternary weights, one scale per row (TWN): codes t in {-1, 0, 1} with t = sign(w) where |w| > 0.7 mean|w|,
    scale = mean |w| over the kept entries; ``w ~= scale[..., None] * t``."""
    a = w.abs().float()
    delta = 0.7 * a.mean(-1, keepdim=True)
    keep = a > delta
    t = torch.sign(w.float()) * keep
    scale = (a * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    return t.to(torch.int8), scale


def pack2(t: torch.Tensor) -> torch.Tensor:
    """Ternary codes [..., n] -> uint8 [..., ceil(n / 4)], 2 bits each (t + 1 in {0, 1, 2}), four to a byte."""
    n = t.shape[-1]
    pad = (-n) % 4
    codes = F.pad((t + 1).to(torch.uint8), (0, pad), value=1)  # padding decodes to 0
    codes = codes.view(*t.shape[:-1], -1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=t.device)
    return (codes << shifts).sum(-1, dtype=torch.uint8)


def unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [..., m] -> ternary codes int8 [..., n] (the inverse of ``pack2``)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.int8) - 1


@dataclass
class Sketch:
    """What the selector reads per (token, expert), derived from the weights alone (no calibration)."""

    codes: torch.Tensor | None = None  # uint8 [E, 2I, ceil(H/4)]: ternary gate and up rows, packed
    scale: torch.Tensor | None = None  # [E, 2I]: their row scales
    ternary: torch.Tensor | None = None  # [E, 2I, H]: scale * codes, unpacked once for the fast path
    gate_norms: torch.Tensor | None = None  # [E, H]: ||W_gate[:, j]|| (wina)
    up_norms: torch.Tensor | None = None  # [E, H]: ||W_up[:, j]|| (wina)
    down_norms: torch.Tensor | None = None  # [E, I]: ||W_down[:, i]||
    lowrank_a: torch.Tensor | None = None  # [E, H, r]: W_down ~= A B
    lowrank_b: torch.Tensor | None = None  # [E, r, I]
    key: tuple = field(default_factory=tuple)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a selection reads for one expert (its row of each): what its bytes count."""
        names = ("codes", "scale", "gate_norms", "up_norms", "down_norms", "lowrank_a", "lowrank_b")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class ReadCounter:
    """Bytes read, summed over (token, expert) pairs: ``weights`` (elements of the gate, up and down matrices),
    ``selector`` (the sketch or norms, thresholds and biases the selection and the output read), ``pairs``."""

    weights: int = 0
    selector: int = 0
    pairs: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ChannelTopKExperts(SwiGLUExperts):
    """Dense SwiGLU weights, read per (token, expert) only where the selector says (see the module docstring).

    budget: fraction of each expert weight matrix a token reads, in (0, 1]
    selector: sketch (the paper's weight-only reader), wina (WINA's input-side scores), down (gate and up read whole)
    rule: topk (the paper's: a fixed count per token, no calibration) or threshold (calibrated baseline)
    rank: rank of the sketch's low-rank recovery map (default 8; 0: none; sketch selector only)
    """

    name = "channel-topk"
    summary = ("SwiGLU experts that read, per token, only the channels a selector picks before reading: a ternary "
               "sketch of the weights with low-rank recovery (default), WINA's input-side scores, or down-only.")
    paper = ("Channel Selection for MoE Decoding Needs No Calibration Data (2026); Chen et al., WINA: Weight Informed "
             "Neuron Activation for Accelerating LLM Inference, 2025, arXiv:2505.19427")
    card = "cards/channel-topk.md"
    space = "compression-lab"

    def __init__(self, *args, budget: float = 0.5, selector: str = "sketch", rule: str = "topk",
                 rank: int | None = None, **kwargs):
        rank = check_options(budget, selector, rule, rank)
        super().__init__(*args, **kwargs)
        H, I = self.hidden_size, self.intermediate_size
        if selector == "sketch" and rank > min(H, I):
            raise ValueError(f"rank={rank} exceeds the down projection's smaller side {min(H, I)}")
        self.budget, self.selector, self.rule, self.rank = float(budget), selector, rule, rank
        self.channels = channels_for(self.budget, I)  # intermediate channels kept (top-k)
        self.hidden_channels = channels_for(self.budget, H)  # hidden input channels kept (wina's gate and up)
        if rule == "threshold":  # per expert: gate, up, down input thresholds (only the ones the selector uses)
            self.register_buffer("thresholds", torch.zeros(self.num_experts, len(THRESHOLD_SLOTS), dtype=torch.float32))
        self._sketch = Sketch()
        self.counter: ReadCounter | None = None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: SwiGLUExperts, budget: float = 0.5, selector: str = "sketch", rule: str = "topk",
                   rank: int | None = None) -> "ChannelTopKExperts":
        w = experts.gate_up_proj
        new = cls(**experts.options(), budget=budget, selector=selector, rule=rule, rank=rank).to(w.device, w.dtype)
        new.load_state_dict(experts.state_dict(), strict=False)
        return new

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if getattr(self, "thresholds", None) is not None and self.thresholds.dtype != torch.float32:
            self.thresholds = self.thresholds.float()  # thresholds compare float32 scores: they stay float32
        self._sketch = Sketch()
        return out

    def options(self) -> dict:
        opts = {**super().options(), "budget": self.budget, "selector": self.selector, "rule": self.rule}
        return {**opts, "rank": self.rank} if self.selector == "sketch" else opts

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        if self.rule == "threshold":
            refuse_missing(self, ["thresholds"])  # calibrated on data: nothing to make them from
            init.zeros_(self.thresholds)

    def supports_expert_parallel(self) -> bool:
        return self._stored() <= {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "thresholds"}

    # ---- the selector's sketch: made from the weights alone, remade whenever they change -----------------------
    def sketch(self) -> Sketch:
        gu, down = self.gate_up_proj, self.down_proj
        key = (gu.data_ptr(), gu._version, down.data_ptr(), down._version, gu.dtype, str(gu.device))
        if self._sketch.key != key:
            self._sketch = self._make_sketch(key)
        return self._sketch

    @torch.no_grad()
    def _make_sketch(self, key) -> Sketch:
        I, dtype = self.intermediate_size, self.gate_up_proj.dtype
        gu, down = self.gate_up_proj.detach(), self.down_proj.detach()
        s = Sketch(key=key, down_norms=down.float().norm(dim=1).to(dtype))  # [E, I]
        if self.selector == "wina":
            s.gate_norms = gu[:, :I].float().norm(dim=1).to(dtype)  # [E, H]
            s.up_norms = gu[:, I:].float().norm(dim=1).to(dtype)
        if self.selector == "sketch":
            t, scale = ternarize(gu)
            s.codes, s.scale = pack2(t), scale.to(dtype)
            s.ternary = unpack2(s.codes, self.hidden_size).to(dtype) * s.scale[..., None]
            if self.rank:
                u, sv, vh = torch.linalg.svd(down.float(), full_matrices=False)  # [E,H,m], [E,m], [E,m,I]
                s.lowrank_a = (u[..., :self.rank] * sv[:, None, :self.rank]).to(dtype)
                s.lowrank_b = vh[:, :self.rank].to(dtype)
        return s

    def sketch_nbytes(self) -> int:
        """Bytes of the selector's state for all experts (the sketch or norms, and thresholds)."""
        s = self.sketch()
        return sum(_nbytes(t) for t in s.tensors().values()) + \
            (_nbytes(self.thresholds) if self.rule == "threshold" else 0)

    def _selector_bytes_per_pair(self) -> int:
        """What one (token, expert) pair reads besides weight-matrix elements: the expert's row of every sketch
        tensor, its thresholds, and the biases."""
        s = self.sketch()
        n = sum(_nbytes(t[0]) for t in s.tensors().values())
        if self.rule == "threshold":
            n += _nbytes(self.thresholds[0])
        for b in (self.gate_up_proj_bias, self.down_proj_bias):
            n += 0 if b is None else _nbytes(b[0])
        return n

    def expert_weight_bytes(self) -> int:
        """Bytes of one expert's three weight matrices."""
        return 3 * self.intermediate_size * self.hidden_size * self.gate_up_proj.element_size()

    def nbytes(self) -> int:
        return super().nbytes() + self.sketch_nbytes() - (_nbytes(self.thresholds) if self.rule == "threshold" else 0)

    def active_parameters(self, k: int) -> int:
        """Weight elements one token reads with k experts (the selector's sketch not included)."""
        H, I = self.hidden_size, self.intermediate_size
        if self.selector == "down":
            return k * (2 * I * H + self.channels * H)
        if self.selector == "wina":
            return k * (2 * self.hidden_channels * I + self.channels * H)
        return k * 3 * self.channels * H

    # ---- selection ----------------------------------------------------------------------------------------------
    def _keep(self, score: torch.Tensor, count: int, e: int, slot: int) -> torch.Tensor:
        """Boolean mask [n, D] of the entries kept: the top ``count`` per row, or those above the threshold."""
        if self.rule == "threshold":
            return score > self.thresholds[e, slot]
        if count >= score.shape[-1]:
            return torch.ones_like(score, dtype=torch.bool)
        idx = score.topk(count, dim=-1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)

    def _estimate(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """The sketch's estimate h~ [n, I] of the intermediate activation."""
        s = self.sketch()
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e].detach()
        return self.glu(linear(x, s.ternary[e], b1))

    def scores(self, e: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The selector's scores for expert e's tokens ``x [n, H]``, float32, keyed by the matrix whose input
        they select (``gate``/``up``: hidden channels; ``down``: intermediate channels). For wina, ``down``
        scores follow from the gate and up inputs the rule keeps."""
        s = self.sketch()
        x = x.detach()
        if self.selector == "sketch":
            return {"down": self._estimate(e, x).abs().float() * s.down_norms[e].float()}
        if self.selector == "down":
            with torch.no_grad():
                h = super().glu(linear(x, self.gate_up_proj[e], None if self.gate_up_proj_bias is None
                                         else self.gate_up_proj_bias[e]))
            return {"down": h.abs().float() * s.down_norms[e].float()}
        out = {"gate": x.abs().float() * s.gate_norms[e].float(), "up": x.abs().float() * s.up_norms[e].float()}
        with torch.no_grad():
            h = self._wina_hidden(e, x, self._keep(out["gate"], self.hidden_channels, e, 0),
                                  self._keep(out["up"], self.hidden_channels, e, 1))
        out["down"] = h.abs().float() * s.down_norms[e].float()
        return out

    def _wina_hidden(self, e, x, keep_g, keep_u):
        I = self.intermediate_size
        w, b = self.gate_up_proj[e], self.gate_up_proj_bias
        g = linear(x * keep_g.to(x.dtype), w[:I], None if b is None else b[e, :I])
        u = linear(x * keep_u.to(x.dtype), w[I:], None if b is None else b[e, I:])
        return self._act(g, u, self.swiglu_limit, self.swiglu_alpha)

    # ---- the fast path ------------------------------------------------------------------------------------------
    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GATHER_TOKENS:
            return self._expert_gather(e, x)
        return self._expert_masked(e, x)

    def _count(self, n: int, weight_elements) -> None:
        if self.counter is not None:
            c = self.counter
            c.weights += int(weight_elements) * self.gate_up_proj.element_size()
            c.selector += n * self._selector_bytes_per_pair()
            c.pairs += n

    def _expert_masked(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Many tokens: the same function with masks over whole matrices (prefill)."""
        s, H, I = self.sketch(), self.hidden_size, self.intermediate_size
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        if self.selector == "wina":
            sc = self.scores(e, x)
            keep_g = self._keep(sc["gate"], self.hidden_channels, e, 0)
            keep_u = self._keep(sc["up"], self.hidden_channels, e, 1)
            h = self._wina_hidden(e, x, keep_g, keep_u)
            keep = self._keep(h.detach().abs().float() * s.down_norms[e].float(), self.channels, e, 2)
            self._count(x.shape[0], (keep_g.sum() + keep_u.sum()) * I + keep.sum() * H)
            return linear(h * keep.to(h.dtype), self.down_proj[e], b2)
        h = self.glu(linear(x, self.gate_up_proj[e], b1))
        if self.selector == "down":
            keep = self._keep(h.detach().abs().float() * s.down_norms[e].float(), self.channels, e, 2)
            self._count(x.shape[0], x.shape[0] * 2 * I * H + keep.sum() * H)
            return linear(h * keep.to(h.dtype), self.down_proj[e], b2)
        est = self._estimate(e, x)
        keep = self._keep(est.detach().abs().float() * s.down_norms[e].float(), self.channels, e, 2)
        self._count(x.shape[0], keep.sum() * 3 * H)
        y = linear(h * keep.to(h.dtype), self.down_proj[e], b2)
        if self.rank:
            y = y + linear(linear(est * (~keep).to(est.dtype), s.lowrank_b[e]), s.lowrank_a[e])
        return y

    @staticmethod
    def _rows(keep: torch.Tensor):
        """Indices [n, m] of the kept entries (m: the most any row keeps) and which of them are real."""
        m = max(1, int(keep.sum(-1).max()))
        idx = keep.to(torch.int8).topk(m, dim=-1, sorted=False).indices
        return idx, keep.gather(-1, idx)

    def _expert_gather(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Few tokens (decode): gather only the selected rows and columns of each matrix."""
        s, H, I = self.sketch(), self.hidden_size, self.intermediate_size
        gu, down_t = self.gate_up_proj[e], self.down_proj[e].t()  # [2I, H], [I, H] (column i of down = row i)
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        est = None
        if self.selector == "wina":
            sc = self.scores(e, x)
            parts = []
            for slot, rows in ((0, slice(0, I)), (1, slice(I, 2 * I))):
                keep_in = self._keep(sc[THRESHOLD_SLOTS[slot]], self.hidden_channels, e, slot)
                idx, valid = self._rows(keep_in)
                cols = gu[rows].t()[idx]  # [n, m, I]: only the kept columns
                xin = (x.gather(1, idx) * valid.to(x.dtype)).unsqueeze(1)
                pre = torch.bmm(xin, cols).squeeze(1)
                parts.append(pre if b1 is None else pre + b1[rows])
                self._count(0, valid.sum() * I)
            h_all = self._act(parts[0], parts[1], self.swiglu_limit, self.swiglu_alpha)
            keep = self._keep(h_all.detach().abs().float() * s.down_norms[e].float(), self.channels, e, 2)
            idx, valid = self._rows(keep)
            h = h_all.gather(1, idx)
            self._count(x.shape[0], valid.sum() * H)
        else:
            if self.selector == "down":
                h_all = self.glu(linear(x, gu, b1))
                score = h_all.detach().abs().float() * s.down_norms[e].float()
            else:
                est = self._estimate(e, x)
                score = est.detach().abs().float() * s.down_norms[e].float()
            keep = self._keep(score, self.channels, e, 2)
            idx, valid = self._rows(keep)
            if self.selector == "down":
                h = h_all.gather(1, idx)
                self._count(x.shape[0], x.shape[0] * 2 * I * H + valid.sum() * H)
            else:
                xin = x.unsqueeze(-1)  # [n, H, 1]
                g = torch.bmm(gu[idx], xin).squeeze(-1)  # [n, m]: rows idx of gate only
                u = torch.bmm(gu[idx + I], xin).squeeze(-1)
                if b1 is not None:
                    g, u = g + b1[idx], u + b1[idx + I]
                h = self._act(g, u, self.swiglu_limit, self.swiglu_alpha)
                self._count(x.shape[0], valid.sum() * 3 * H)
        h = h * valid.to(h.dtype)
        y = torch.bmm(h.unsqueeze(1), down_t[idx]).squeeze(1)  # only the kept columns of down
        if b2 is not None:
            y = y + b2
        if est is not None and self.rank:
            y = y + linear(linear(est * (~keep).to(est.dtype), s.lowrank_b[e]), s.lowrank_a[e])
        return y

    def forward(self, hidden, routing):
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, self.expert)

    # ---- the reference: one pair at a time, through a reader that counts what it gathers -------------------------
    def reference(self, hidden, routing, counter: ReadCounter | None = None):
        """One (token, expert) pair at a time. Weights are read only through ``read``, which gathers the named
        rows (or columns) and counts their bytes; the selection sees only the expert's sketch (or, for ``down``,
        its whole gate and up, as that variant reads them)."""
        counter = counter if counter is not None else ReadCounter()
        H, I = self.hidden_size, self.intermediate_size
        act = lambda g, u: self._act(g, u, self.swiglu_limit, self.swiglu_alpha)  # noqa: E731

        def read(matrix: torch.Tensor, index) -> torch.Tensor:
            part = matrix[index]
            counter.weights += _nbytes(part)
            return part

        def read_selector(t: torch.Tensor) -> torch.Tensor:
            counter.selector += _nbytes(t)
            return t

        def top(score: torch.Tensor, count: int, th, slot: int) -> torch.Tensor:
            if self.rule == "threshold":
                return (score > th[slot]).nonzero().flatten()
            return score.topk(min(count, score.numel())).indices

        s = self.sketch()
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            x = hidden[t]
            for slot, e in enumerate(routing.indices[t].tolist()):
                if e >= self.num_experts:
                    continue
                counter.pairs += 1
                gate_w, up_w = self.gate_up_proj[e, :I], self.gate_up_proj[e, I:]
                down_cols = self.down_proj[e].t()  # row i: column i of down
                b1 = None if self.gate_up_proj_bias is None else read_selector(self.gate_up_proj_bias[e])
                b2 = None if self.down_proj_bias is None else read_selector(self.down_proj_bias[e])
                bg = 0 if b1 is None else b1[:I]
                bu = 0 if b1 is None else b1[I:]
                dn = read_selector(s.down_norms[e]).float()
                th = read_selector(self.thresholds[e]) if self.rule == "threshold" else None
                est = None
                if self.selector == "wina":
                    xa = x.detach().abs().float()
                    jg = top(xa * read_selector(s.gate_norms[e]).float(), self.hidden_channels, th, 0)
                    ju = top(xa * read_selector(s.up_norms[e]).float(), self.hidden_channels, th, 1)
                    g = read(gate_w.t(), jg).t() @ x[jg] + bg  # columns jg of gate
                    u = read(up_w.t(), ju).t() @ x[ju] + bu
                    h_all = act(g, u)
                    keep = top(h_all.detach().abs().float() * dn, self.channels, th, 2)
                    h = h_all[keep]
                elif self.selector == "down":
                    h_all = act(read(gate_w, slice(None)) @ x + bg, read(up_w, slice(None)) @ x + bu)
                    keep = top(h_all.detach().abs().float() * dn, self.channels, th, 2)
                    h = h_all[keep]
                else:
                    codes = read_selector(s.codes[e])
                    ternary = unpack2(codes, H).to(x.dtype) * read_selector(s.scale[e]).to(x.dtype)[:, None]
                    pre = ternary @ x + (0 if b1 is None else b1.detach())
                    est = act(pre[:I], pre[I:])
                    keep = top(est.detach().abs().float() * dn, self.channels, th, 2)
                    h = act(read(gate_w, keep) @ x + (0 if b1 is None else bg[keep]),
                            read(up_w, keep) @ x + (0 if b1 is None else bu[keep]))
                y = read(down_cols, keep).t() @ h
                if b2 is not None:
                    y = y + b2
                if est is not None and self.rank:
                    skipped = est.clone()
                    skipped[keep] = 0
                    y = y + read_selector(s.lowrank_a[e]) @ (read_selector(s.lowrank_b[e]) @ skipped)
                out[t] = out[t] + routing.weights[t, slot].to(hidden.dtype) * y
        return out

    # ---- the calibrated threshold (the baseline rule) -----------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, indices: torch.Tensor) -> dict:
        """Set every expert's thresholds so that, over the calibration tokens routed to it (``x [T, H]``,
        ``indices [T, k]``), the fraction of entries kept is the budget; an expert no token reached is
        calibrated on all of them. Wina's down threshold is set on the h its calibrated gate and up give.
        Returns the kept fraction per matrix, averaged over experts."""
        if self.rule != "threshold":
            raise ValueError("calibrate() sets the threshold rule's thresholds; this module uses top-k")
        kept = {name: [] for name in THRESHOLD_SLOTS}
        for e in range(self.num_experts):
            rows = (indices == e).any(-1)
            xe = x[rows] if rows.any() else x
            self.thresholds[e] = -1.0  # keep all while the earlier matrices are being calibrated
            order = ["gate", "up", "down"] if self.selector == "wina" else ["down"]
            for name in order:
                slot = THRESHOLD_SLOTS.index(name)
                score = self.scores(e, xe)[name].flatten()
                drop = score.numel() - int(round(self.budget * score.numel()))
                self.thresholds[e, slot] = -1.0 if drop <= 0 else score.kthvalue(drop).values.item()
                kept[name].append(float((score > self.thresholds[e, slot]).float().mean()))
        return {k: sum(v) / len(v) for k, v in kept.items() if v}
