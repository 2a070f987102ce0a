"""modality-groups: SwiGLU experts partitioned into one contiguous group per modality (MoHAVE).

Weights keep the fused transformers v5 layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), so
dispatch, sizes and surgery are SwiGLU's; what is added is the partition: ``groups`` names the modalities
in order and ``group_sizes`` says how many experts each owns (experts 0..n0-1 are the first group's, ...).
Which group a token reaches is the router's decision (``hierarchical-modality``).
"""
from __future__ import annotations

from zoo.components.controls import Control
from zoo.moe import SwiGLUExperts

MODALITIES = ("text", "vision", "audio")


class ModalityGroupExperts(SwiGLUExperts):
    name = "modality-groups"
    summary = "SwiGLU experts partitioned into per-modality groups (text, vision, audio) of given sizes."
    paper = ("Kim et al., MoHAVE: Mixture of Hierarchical Audio-Visual Experts for Robust Speech Recognition, "
             "ICML 2025, arXiv:2502.10447")
    card = "cards/modality-groups.md"
    space = "multimodal-digits"

    @classmethod
    def demo_controls(cls, model=None):  # the partition; the expert shapes are the layer's
        return [Control("group_sizes", "json", [2, 2, 2], help="experts per modality group, in the order of groups"),
                Control("groups", "json", list(MODALITIES), help="the modalities, in order")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"group_sizes": [2, 2, 2]}, "strong": {"group_sizes": [4, 2, 2]}}

    def __init__(self, group_sizes: list[int], hidden_size: int, intermediate_size: int,
                 groups: list[str] = MODALITIES, num_experts: int | None = None, **options):
        group_sizes, groups = [int(n) for n in group_sizes], [str(g) for g in groups]
        if len(group_sizes) != len(groups) or min(group_sizes, default=0) < 1:
            raise ValueError(f"group_sizes {group_sizes} must give a positive size for each of {groups}")
        if num_experts is not None and num_experts != sum(group_sizes):
            raise ValueError(f"num_experts={num_experts} but group_sizes sum to {sum(group_sizes)}")
        super().__init__(sum(group_sizes), hidden_size, intermediate_size, **options)
        self.group_sizes, self.groups = group_sizes, groups

    def options(self) -> dict:
        opts = super().options()
        return {**opts, "group_sizes": list(self.group_sizes), "groups": list(self.groups)}

    @property
    def group_of(self) -> list[int]:
        """The group index of each expert."""
        return [g for g, n in enumerate(self.group_sizes) for _ in range(n)]

    def group_range(self, group: str | int) -> range:
        """The expert indices of one group (by name or position)."""
        g = self.groups.index(group) if isinstance(group, str) else int(group)
        start = sum(self.group_sizes[:g])
        return range(start, start + self.group_sizes[g])

    def extra_repr(self) -> str:
        return ", ".join(f"{g}: {n}" for g, n in zip(self.groups, self.group_sizes))
