"""earth-adapter: Earth-Adapter's frequency-guided mixture of adapters on zoo_mm's vision features.

The vision encoder's output tokens ``v [B, P, H]`` form the image's patch grid ``[B, h, w, H]``. A 2-D discrete
Fourier transform over the grid (orthonormal), a low-pass box mask and its complement split them into a
low-frequency and a high-frequency band, ``v_low = IDFT(M * DFT(v))`` and ``v_high = v - v_low`` (the two bands
sum to ``v`` exactly). Three bottleneck adapters (``H -> dim -> H``, ReLU) are the experts: the spatial one reads
``v``, the low one ``v_low``, the high one ``v_high``; a linear router on ``v`` weights them per token (softmax
over the three), and the mixture, times a learned scale (0.1 at the start), is added to the frozen features:

    out = v + scale * sum_i softmax(W_r v)_i * adapter_i(band_i)

The mask keeps the frequencies with ``|f_y|, |f_x| <= cutoff_ratio / 2`` (cycles per patch, Nyquist 0.5): a box
around DC as in the paper, symmetric in +-f, so each band is real. ``split="none"`` is the control: the same
three adapters and router, each adapter reading the unsplit ``v`` (no DFT, the same parameters).

The adapters' output layers start at zero, so attaching changes nothing until training moves them; the backbone
is frozen and only the adapter trains. ``config.zoo_modules`` records the wrapped encoder, so ``save_pretrained``
and ``from_pretrained`` (after ``import zoo``) rebuild it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo import Adapter
from zoo.components.controls import Control
from zoo.components.options import check_int, suggest
from zoo_multimodal.modeling_zoo_mm import Encoder

SPLITS = ("frequency", "none")  # "none": the plain-adapter control, without the frequency split
EXPERTS = ("spatial", "low", "high")  # what each adapter reads (with split="none", all read the unsplit features)
SCALE = 0.1  # the paper's initial output scale


def low_mask(h: int, w: int, cutoff_ratio: float, device=None) -> torch.Tensor:
    """``[h, w]`` bool, in the unshifted DFT layout: frequencies with ``|f_y|, |f_x| <= cutoff_ratio / 2``."""
    fy = torch.fft.fftfreq(h, device=device).abs() <= cutoff_ratio / 2
    fx = torch.fft.fftfreq(w, device=device).abs() <= cutoff_ratio / 2
    return fy[:, None] & fx[None, :]


def split_bands(v: torch.Tensor, grid: tuple[int, int], cutoff_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [B, h*w, H]`` -> (low, high) bands of the same shape, by a 2-D DFT over the patch grid."""
    b, p, c = v.shape
    g = v.reshape(b, *grid, c)
    g = g.float() if g.element_size() < 4 else g  # torch.fft wants float32 at least (half and bf16 are upcast)
    spectrum = torch.fft.fft2(g, dim=(1, 2), norm="ortho")
    mask = low_mask(*grid, cutoff_ratio, device=v.device)[None, :, :, None]
    low = torch.fft.ifft2(spectrum * mask, dim=(1, 2), norm="ortho").real  # real: the mask is symmetric in +-f
    return low.reshape(b, p, c).to(v.dtype), (g - low).reshape(b, p, c).to(v.dtype)


class FrequencyMixture(nn.Module):
    """The mixture of adapters: three bottleneck experts, a per-token softmax router, a learned output scale."""

    def __init__(self, hidden: int, grid: tuple[int, int], dim: int, cutoff_ratio: float, split: str, like=None):
        super().__init__()
        like = like or {}
        self.grid, self.dim, self.cutoff_ratio, self.split = tuple(grid), dim, float(cutoff_ratio), split
        self.down = nn.ModuleList(nn.Linear(hidden, dim, **like) for _ in EXPERTS)
        self.up = nn.ModuleList(nn.Linear(dim, hidden, **like) for _ in EXPERTS)
        self.router = nn.Linear(hidden, len(EXPERTS), **like)
        self.scale = nn.Parameter(torch.full((), SCALE, **like))
        self.init_weights()

    def init_weights(self, std: float | None = None) -> None:
        """Experts' input layers and the router as torch's Linear default (the paper keeps Kaiming-uniform); the
        experts' output layers at zero, so the adapter starts as no change; the scale at 0.1."""
        for lin in [*self.down, self.router]:
            init.kaiming_uniform_(lin.weight, a=math.sqrt(5))
            bound = 1 / math.sqrt(lin.in_features)
            init.uniform_(lin.bias, -bound, bound)
        for lin in self.up:
            init.zeros_(lin.weight)
            init.zeros_(lin.bias)
        init.constant_(self.scale, SCALE)

    def bands(self, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What each expert reads: (v, v_low, v_high), or v three times with ``split="none"``."""
        if self.split == "none":
            return v, v, v
        return (v, *split_bands(v, self.grid, self.cutoff_ratio))

    def router_weights(self, v: torch.Tensor) -> torch.Tensor:
        """``[B, P, 3]``: each token's softmax weights over the experts."""
        logits = self.router(v)
        return (logits.float() if logits.element_size() < 4 else logits).softmax(-1).to(v.dtype)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """The residual ``scale * sum_i w_i adapter_i(band_i)`` for ``v [B, P, H]`` (add it to ``v``)."""
        weights = self.router_weights(v)
        delta = sum(weights[..., i:i + 1] * up(F.relu(down(x)))
                    for i, (down, up, x) in enumerate(zip(self.down, self.up, self.bands(v))))
        return self.scale * delta

    def extra_repr(self) -> str:
        return f"grid={self.grid}, dim={self.dim}, cutoff_ratio={self.cutoff_ratio}, split={self.split!r}"


class EarthAdapterEncoder(Encoder):
    """zoo_mm's vision encoder (the same frozen ``fc1``, ``fc2``, ``position``) with Earth-Adapter on its output."""

    def __init__(self, base: Encoder, grid: tuple[int, int], dim: int, cutoff_ratio: float, split: str):
        nn.Module.__init__(self)
        self.fc1, self.fc2, self.position = base.fc1, base.fc2, base.position
        like = {"dtype": base.fc2.weight.dtype, "device": base.fc2.weight.device}
        self.adapter = FrequencyMixture(base.fc2.out_features, grid, dim, cutoff_ratio, split, like)

    def zoo_spec(self) -> dict:
        a = self.adapter
        return {"adapter": EarthAdapter.name, "dim": a.dim, "cutoff_ratio": a.cutoff_ratio, "split": a.split,
                "grid": list(a.grid)}

    def forward(self, x):
        v = super().forward(x)
        return v + self.adapter(v)


class EarthAdapter(Adapter):
    name = "earth-adapter"
    summary = ("Earth-Adapter: DFT-split vision features, low/high-frequency and spatial adapter experts mixed "
               "by a per-token router, added to the frozen features.")
    paper = ("Hu et al., Earth-Adapter: Bridge the Geospatial Domain Gaps with Mixture of Frequency Adaptation, "
             "2025, arXiv:2504.06220")
    card = "cards/earth-adapter.md"
    space = "multimodal-digits"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("dim", "int", 16, low=1, high=256, step=1, help="bottleneck width of each adapter expert"),
                Control("cutoff_ratio", "float", 0.3, low=0.0, high=0.95, step=0.05,
                        help="low band: |f| <= cutoff_ratio / 2 cycles per patch on each axis"),
                Control("split", "choice", "frequency", choices=SPLITS,
                        help="frequency (Earth-Adapter) or none (the plain-adapter control)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"dim": 8}, "strong": {"dim": 32}}

    @classmethod
    def demo_unfit(cls, model):
        if model.config.model_type == "zoo_mm":
            return ""
        return ("earth-adapter adapts the image patch features of a multimodal model (zoo_mm): this "
                f"{model.config.model_type} model has no vision encoder (see the multimodal-digits Space).")

    def __init__(self, dim: int = 16, cutoff_ratio: float = 0.3, split: str = "frequency"):
        super().__init__(dim=dim, cutoff_ratio=cutoff_ratio, split=split)
        self.dim = check_int("dim", dim, 1)
        if isinstance(cutoff_ratio, bool) or not isinstance(cutoff_ratio, (int, float)) \
                or not 0 <= cutoff_ratio < 1:
            raise ValueError(f"cutoff_ratio must be a number in [0, 1) (1 leaves no high band), got {cutoff_ratio!r}")
        self.cutoff_ratio = float(cutoff_ratio)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}{suggest(str(split), SPLITS)}")
        self.split = split

    def check_model(self, model) -> tuple[int, int]:
        """The patch grid ``(h, w)`` of a zoo_mm model that has no earth-adapter yet; raises (changing nothing)
        otherwise."""
        if model.config.model_type != "zoo_mm" or not isinstance(getattr(model.model, "vision", None), Encoder):
            raise TypeError(self.demo_unfit(model) or "earth-adapter needs a zoo_mm model with a vision encoder")
        if isinstance(model.model.vision, EarthAdapterEncoder):
            raise ValueError("this model's vision encoder already carries an earth-adapter")
        side = model.config.image_size // model.config.patch_size
        return side, side

    def attach(self, model):
        grid = self.check_model(model)
        module = EarthAdapterEncoder(model.model.vision, grid, self.dim, self.cutoff_ratio, self.split)
        for p in model.parameters():  # the backbone is frozen: only the adapter trains
            p.requires_grad_(False)
        module.adapter.requires_grad_(True)
        model.model.vision = module
        return model

    @classmethod
    def build_module(cls, replaced: Encoder, spec: dict) -> EarthAdapterEncoder:
        """The empty module ``config.zoo_modules`` describes (``zoo.moe.layout.apply_modules`` calls this on load)."""
        return EarthAdapterEncoder(replaced, tuple(spec["grid"]), spec["dim"], spec["cutoff_ratio"], spec["split"])
