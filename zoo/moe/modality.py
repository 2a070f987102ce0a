"""Per-modality expert blocks selected by token type (ERNIE-4.5-VL): one MoE layer holds a SparseMoE per modality,
each with its own router and experts, and every token goes through the part of its modality alone, beside one
shared MLP that every token goes through.

``ModalityMoE(parts, shared_experts)``: ``parts`` maps a name to a SparseMoE, in token-type order: a token of type t
goes to part ``min(t, len(parts) - 1)`` (ERNIE-4.5-VL: type 0 text, 1 image and 2 video both to the vision part);
without token types every token is of type 0. Each part sits in a ``ModalityPart`` at its name, which holds it at
``mlp`` as a decoder layer holds its block: a family lists the parts' paths (``Family.layer_paths``), so the layout
gives each part an entry of its own and every compressor, router swap and export visits each part as an MoE block of
its own; parts may differ in expert count, k, router or experts kind after that.

Every part is called on every forward, on no rows where its modality is absent (the native block skips it there:
the same output; a SparseMoE given no rows returns none without routing), so the layer-at-a-time engine finds each
part called once per batch. The router logits a balance loss reads are the layer's, one row per token in token order
(each row from its modality's router), as the native block reports them.
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.moe import router_capture
from zoo.moe.block import SparseMoE, unwrapped


class ModalityPart(nn.Module):
    """One modality's SparseMoE, at ``mlp`` (the attribute the zoo's layout reads below each listed path)."""

    def __init__(self, block: SparseMoE):
        super().__init__()
        self.mlp = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class ModalityMoE(nn.Module):
    """Per-modality SparseMoE parts chosen per token by its type, plus an optional shared MLP: [B, S, H] -> [B, S, H].
    ``forward(hidden, token_types=None)``: ``token_types`` [B, S] integers (None or all zero: every token type 0)."""

    def __init__(self, parts: dict[str, SparseMoE], shared_experts: nn.Module | None = None):
        super().__init__()
        if not parts or not all(isinstance(p, SparseMoE) for p in parts.values()):
            raise ValueError(f"parts must map names to SparseMoE blocks, got {parts!r}")
        bad = [n for n in parts if not (isinstance(n, str) and n.isidentifier()) or n in ("shared_experts", "parts")]
        if bad:
            raise ValueError(f"part names must be identifiers other than 'shared_experts' and 'parts', got {bad}")
        widths = {unwrapped(p.router).hidden_size for p in parts.values()}
        if len(widths) != 1:
            raise ValueError(f"the parts read inputs of different widths {sorted(widths)}")
        self.part_names = tuple(parts)
        for name, block in parts.items():
            setattr(self, name, ModalityPart(block))
        self.shared_experts = shared_experts

    def parts(self) -> list[SparseMoE]:
        return [getattr(self, name).mlp for name in self.part_names]

    def forward(self, hidden: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        holders = [getattr(self, name) for name in self.part_names]
        if token_types is not None and (token_types.numel() != x.shape[0] or token_types.is_floating_point()
                                        or token_types.is_complex() or bool((token_types < 0).any())):
            raise ValueError(f"token types must be non-negative integers, one per token ({x.shape[0]}), got a "
                             f"{token_types.dtype} tensor of shape {tuple(token_types.shape)}")
        if token_types is None or not token_types.any():
            out = holders[0](x)
            for holder in holders[1:]:
                holder(x[:0])  # no rows (see the module's docstring)
        else:
            part_of = token_types.reshape(-1).long().clamp(0, len(holders) - 1)
            out = x.new_zeros(x.shape)
            seen = router_capture.recording()
            start, part_rows = (len(seen) if seen is not None else 0), []
            for p, holder in enumerate(holders):
                rows = (part_of == p).nonzero().squeeze(1)
                out = out.index_copy(0, rows, holder(x.index_select(0, rows)).to(out.dtype))
                part_rows.append(rows)
            if seen is not None and len(seen) - start == len(holders):  # the balance loss reads the layer's logits
                router_capture.merge_part_records(seen, start, part_rows, x.shape[0])  # in token order, as native
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(hidden.shape)

