"""moe-svd: MoE-SVD, training-free decomposition of experts into low-rank factors.

1. Scaling matrices from calibration (activation-aware SVD): the Gram matrix of the layer's input, and of
   each expert's intermediate activation over the tokens routed to it; ``S = cholesky(Gram)``.
2. SVD of the scaled weight ``W S``, truncated to rank r.
3. V-matrix sharing: the right factor of the most frequently routed expert is shared by all experts of
   the layer; each expert's ``U_e`` is the best left factor for that shared V in the scaled metric.
4. U-matrix trimming: only the ``u_keep`` fraction of U matrices of the most frequent experts is kept;
   every other expert reuses the kept U that reconstructs it best.
Selective decomposition: layers are ranked by a sensitivity score and the least sensitive are decomposed,
until the expert parameters kept reach ``ratio``. ``sensitivity="paper"`` (the default) is MoE-SVD's score
from weight singular values and activation statistics, S_L = sum_i f_i * r_i * a_i over the layer's experts:
f_i the expert's sampling (routing) frequency, r_i its principal rank (the share of its rank needed to hold
``energy`` of the squared singular values of its weights, mean over gate/up/down), a_i the outlier ratio of the
activations routed to it (entries above ``OUTLIER`` times the token's mean magnitude). The thresholds are ours.
``sensitivity="energy"`` is the zoo's own score: the frequency-weighted share of scaled spectral energy lost
at the rank the layer would get.
"""
import functools
import math

import torch

from zoo import Compressor
from zoo.moe.context import routing_context, row_parts
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.factored import FactoredExperts
from zoo.components.controls import Control

SENSITIVITIES = ("paper", "energy")
ENERGY = 0.9  # principal rank: the singular values that hold this share of the squared spectrum
OUTLIER = 5.0  # an activation entry is an outlier above this multiple of its token's mean magnitude


def cholesky_scale(gram: torch.Tensor) -> torch.Tensor:
    """Lower-triangular S with S S^T = Gram (damped so an unused direction stays invertible)."""
    d = gram.shape[0]
    damp = 1e-4 * (gram.diagonal().mean() if gram.diagonal().mean() > 0 else 1.0)
    return torch.linalg.cholesky(gram + damp * torch.eye(d, dtype=gram.dtype, device=gram.device))


@torch.no_grad()
def layer_grams(moe, x: torch.Tensor, chunk: int = 4096) -> dict:
    """One MoE layer on its input tokens ``x [T, H]``: input Gram [H, H], per-expert intermediate Grams
    [E, I, I] over the tokens routed to each expert, routed counts [E]."""
    ex = moe.experts
    zeros = functools.partial(torch.zeros, dtype=torch.float64, device=x.device)  # sums where the tokens are
    st = {"input": zeros(ex.hidden_size, ex.hidden_size),  # the experts' input width
          "inter": zeros(moe.num_experts, ex.intermediate_size, ex.intermediate_size),
          "counts": zeros(moe.num_experts), "outliers": zeros(moe.num_experts)}
    for part, ctx in row_parts(x, chunk):  # each chunk routed in the context of its own rows
        with routing_context(ctx):
            routing = moe.route(part)
        part = moe.expert_inputs(part)  # what the experts read (a normed copy where the block has an input norm)
        xd = part.double()
        st["input"] += xd.T @ xd
        for e in range(moe.num_experts):
            tok = (routing.indices == e).any(-1).nonzero().flatten()
            if len(tok):
                h = ex.glu(torch.nn.functional.linear(part[tok], ex.gate_up_proj[e])).double()
                st["inter"][e] += h.T @ h
                st["counts"][e] += len(tok)
                a = part[tok].double().abs()
                st["outliers"][e] += (a > OUTLIER * a.mean(-1, keepdim=True)).sum()
    return st


def principal_rank(w: torch.Tensor, energy: float = ENERGY) -> float:
    """The share of ``w``'s rank needed to hold ``energy`` of its squared singular values (the eigenvalues of its
    smaller Gram matrix: 2.2-3.3x faster than its singular values, one thread, [128-1408, 256-2048] in float64)."""
    w = w.double()
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    sv2 = torch.linalg.eigvalsh(gram).flip(0).clamp(min=0)
    cum = sv2.cumsum(0) / sv2.sum().clamp(min=1e-300)
    return float(int((cum < energy).sum()) + 1) / len(sv2)


def paper_sensitivity(ex, st: dict) -> float:
    """MoE-SVD's S_L = sum_i f_i * r_i * a_i (see the module docstring)."""
    freq = st["counts"] / st["counts"].sum().clamp(min=1)
    total = 0.0
    for e in range(ex.num_experts):
        if not st["counts"][e]:
            continue
        gate, up = ex.gate_up_proj[e].chunk(2)
        r = sum(principal_rank(w) for w in (gate, up, ex.down_proj[e])) / 3
        a = float(st["outliers"][e] / (st["counts"][e] * ex.hidden_size))
        total += float(freq[e]) * r * a
    return total


def fit_shared(weights, scales, anchor: int, rank: int):
    """Shared V from the anchor expert's scaled SVD; each expert's best U for it. Returns (U [E, out, r],
    V [r, in], per-expert lost-energy share)."""
    w_a, s_a = weights[anchor].double(), scales[anchor]
    _, sv, vh = torch.linalg.svd(w_a @ s_a, full_matrices=False)
    v = torch.linalg.solve_triangular(s_a, vh[:rank], upper=False, left=False)  # Vr S^-1, [r, in]
    us, lost = [], []
    for w, s in zip(weights, scales):
        w, m = w.double(), s @ s.T
        u = w @ m @ v.T @ torch.linalg.inv(v @ m @ v.T)
        us.append(u)
        total = (w @ s).pow(2).sum()
        lost.append(float(((w - u @ v) @ s).pow(2).sum() / total.clamp(min=1e-30)))
    return torch.stack(us), v, lost


def reconstruction_errors(weights, scales, us: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[len(weights), len(us)]: ``||(W_e - U_k V) S_e||^2`` for each weight W_e (its scale S_e) and candidate U_k, as
    ``||A||^2 - 2 <A P^T, U_k> + <U_k^T U_k, P P^T>`` with A = W_e S_e and P = V S_e: [out, r] and [r, r] products
    per pair instead of an [out, in] one (64 experts of a real layer: thousands of pairs)."""
    grams = us.transpose(1, 2) @ us  # [K, r, r]
    rows = []
    for w, s in zip(weights, scales):
        a, p = w.double() @ s, v @ s
        rows.append(a.pow(2).sum() - 2 * (us * (a @ p.T)).sum((1, 2)) + (grams * (p @ p.T)).sum((1, 2)))
    return torch.stack(rows) if rows else torch.zeros(0, len(us), dtype=torch.float64)


class MoeSvd(Compressor):
    name = "moe-svd"
    summary = "MoE-SVD: sensitivity-selected layers, low-rank experts with one shared V per layer, trimmed U."
    paper = ("Li et al., MoE-SVD: Structured Mixture-of-Experts LLMs Compression via Singular Value Decomposition, "
             "ICML 2025")
    card = "cards/moe-svd.md"
    space = "compression-lab"
    experts_after = "factored"  # what a later step of the same recipe is judged on
    needs_calibration = True
    inputs_for = ("observe", "compress")
    needs_plan = True

    @classmethod
    def demo_controls(cls, model=None):
        return [Control(key, "float", default, low=0.05, high=1.0, step=0.05, help=text) for key, default, text in (
            ("ratio", 0.75, "share of the expert parameters kept"),
            ("layer_ratio", 0.5, "share of the layers factored"),
            ("u_keep", 1.0, "share of the U bases kept"))] + [
            Control("sensitivity", "choice", "paper", choices=SENSITIVITIES,
                    help="layer ranking: the paper's f x rank x outliers, or the zoo's energy lost")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"ratio": 0.75}, "strong": {"ratio": 0.5, "layer_ratio": 1.0}}

    def __init__(self, ratio: float = 0.75, layer_ratio: float = 0.5, u_keep: float = 1.0, sensitivity: str = "paper"):
        for key, value in (("ratio", ratio), ("layer_ratio", layer_ratio), ("u_keep", u_keep)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
                raise ValueError(f"{key} must be in (0, 1], got {value!r}")
        if sensitivity not in SENSITIVITIES:
            raise ValueError(f"sensitivity must be one of {SENSITIVITIES}, got {sensitivity!r}")
        super().__init__(ratio=ratio, layer_ratio=layer_ratio, u_keep=u_keep, sensitivity=sensitivity)
        self.sensitivity = sensitivity
        self.ratio, self.layer_ratio, self.u_keep = float(ratio), float(layer_ratio), float(u_keep)
        self.results: dict = {}
        self._layers: list[int] = []
        self._sensitivity: dict[int, float] = {}
        self._chosen: list[int] = []
        self._keep = 1.0

    def plan_counts(self, n_layers: int) -> tuple[int, float]:
        """How many layers to decompose, and the fraction of parameters each of them keeps."""
        if self.ratio >= 1:
            return 0, 1.0
        m = math.ceil(n_layers * (1 - self.ratio) / (1 - self.layer_ratio)) if self.layer_ratio < 1 else n_layers + 1
        return (m, self.layer_ratio) if m <= n_layers else (n_layers, self.ratio)

    @staticmethod
    def rank_for(ex: SwiGLUExperts, keep: float, num_u: int) -> int:
        dense = ex.num_experts * 3 * ex.hidden_size * ex.intermediate_size
        per_rank = num_u * (2 * ex.intermediate_size + ex.hidden_size) + ex.hidden_size + ex.intermediate_size
        return max(1, int(keep * dense // per_rank))

    def check_layer(self, index, block):
        if type(block.experts) is not SwiGLUExperts:
            raise ValueError(f"layer {index} has {block.experts.name!r} experts; moe-svd needs dense experts")
        self._layers.append(index)  # check_layer sees every MoE layer before any pass: the plan needs the count

    @torch.no_grad()
    def observe(self, index, block, inputs):
        """Sensitivity of layer ``index``: the paper's score, or the energy lost at the rank a decomposed layer
        would get."""
        st = layer_grams(block, inputs)
        if self.sensitivity == "paper":
            self._sensitivity[index] = paper_sensitivity(block.experts, st)
            return
        _, keep = self.plan_counts(len(self._layers))
        self._sensitivity[index] = self.factor_layer(block.experts, st, keep)[1]

    def plan(self):
        m, self._keep = self.plan_counts(len(self._layers))
        order = sorted(self._sensitivity, key=self._sensitivity.get)  # least sensitive first
        self._chosen = sorted(order[:m])
        self.results = {"decomposed": self._chosen, "sensitivity_score": self.sensitivity,
                        "sensitivity": {str(i): float(f"{v:.5g}") for i, v in sorted(self._sensitivity.items())},
                        "rank": {}}

    @torch.no_grad()
    def compress_layer(self, index, block, inputs):
        if index not in self._chosen:
            return block
        experts = self.factor_layer(block.experts, layer_grams(block, inputs), self._keep)[0]
        self.results["rank"][str(index)] = experts.rank_gate_up
        return block.with_parts(experts=experts)

    def factor_layer(self, ex: SwiGLUExperts, st: dict, keep: float):
        """(FactoredExperts, sensitivity) for one layer at the fraction ``keep`` of its expert parameters."""
        E = ex.num_experts
        freq = st["counts"] / st["counts"].sum().clamp(min=1)
        num_u = max(1, round(self.u_keep * E))
        r = min(self.rank_for(ex, keep, num_u), ex.hidden_size, ex.intermediate_size)
        anchor = int(st["counts"].argmax())
        s_in = cholesky_scale(st["input"])
        u_gu, v_gu, lost_gu = fit_shared([ex.gate_up_proj[e] for e in range(E)], [s_in] * E, anchor, r)
        s_inter = [cholesky_scale(st["inter"][e]) for e in range(E)]
        u_dn, v_dn, lost_dn = fit_shared([ex.down_proj[e] for e in range(E)], s_inter, anchor, r)
        sensitivity = float(sum(f * (a + b) / 2 for f, a, b in zip(freq.tolist(), lost_gu, lost_dn)))
        kept = freq.argsort(descending=True, stable=True)[:num_u].tolist()
        trimmed = [e for e in range(E) if e not in kept]  # each reuses the kept U that reconstructs it best
        err = (reconstruction_errors([ex.gate_up_proj[e] for e in trimmed], [s_in] * len(trimmed), u_gu[kept], v_gu)
               + reconstruction_errors([ex.down_proj[e] for e in trimmed], [s_inter[e] for e in trimmed], u_dn[kept],
                                       v_dn))
        u_index = list(range(E))
        for e, row in zip(trimmed, err):
            u_index[e] = kept[int(row.argmin())]
        slot = {e: n for n, e in enumerate(kept)}
        opts = {k: v for k, v in ex.options().items() if k != "num_experts"}
        new = FactoredExperts(E, rank_gate_up=r, rank_down=r, num_u=num_u,
                              **{k: v for k, v in opts.items() if k not in ("hidden_size", "intermediate_size")},
                              hidden_size=ex.hidden_size, intermediate_size=ex.intermediate_size)
        dtype = ex.gate_up_proj.dtype
        new.gate_up_u.copy_(u_gu[kept].to(dtype))
        new.gate_up_v.copy_(v_gu.to(dtype))
        new.down_u.copy_(u_dn[kept].to(dtype))
        new.down_v.copy_(v_dn.to(dtype))
        new.u_index.copy_(torch.tensor([slot[u] for u in u_index], device=new.u_index.device))
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(ex, name) is not None:
                getattr(new, name).copy_(getattr(ex, name))
        return new.to(dtype), sensitivity
