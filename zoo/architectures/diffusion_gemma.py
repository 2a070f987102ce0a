"""Diffusion Gemma: a block-diffusion language model. Its encoder reads the prompt causally into a key/value cache; its
decoder then denoises a canvas of ``canvas_length`` tokens over several steps, attending to the whole canvas and to
that cache, and the canvas it settles on is appended to the prompt for the next block. Both stacks run the same
weights: the native model ties every weight of encoder layer i to decoder layer i's (``tie_word_embeddings``).

Each layer is a Gemma 4 MoE layer: router, experts and their two norms inside the layer, beside a dense MLP
(``zoo.architectures.gemma4``: ``gemma4-topk``, a normed input and output). Since the two stacks share them, the zoo
holds each layer's MoE part once, as a ``SparseMoE`` at ``moe`` of the decoder layer (the native checkpoint keeps the
decoder's copy), and the encoder layer calls its decoder twin's block. So ``zoo_layout`` lists the decoder's layers
and a component that changes a block changes what both stacks run. Export writes each block's tensors under both
layers, as the native model holds them tied.

The family keeps its own forward and generation. Calibrating layer by layer carries the decoder's layers only: a
component sees the canvas the forward denoises (drawn at random where a batch gives only ``input_ids``), not the
prompt the encoder reads through the same blocks. Refused: ``tie_word_embeddings=False`` (each stack its own
tensors) and streaming (``zoo.editing.stream``)."""
from __future__ import annotations

import torch

from zoo.architectures.family import NotConvertible
from zoo.architectures.gemma4 import Gemma4
from zoo.architectures.generic import GenericFamily

# DiffusionGemmaModel's ties, over the zoo's modules: the encoder's layers have no MoE tensors of their own, so the
# native patterns that only match those (router scale, per-expert scale, expert stacks) go, and the decoder's side of
# the layer pattern leaves out its blocks (the two sides are paired in sorted order)
TIES = {"encoder.language_model.norm.weight": "decoder.norm.weight",
        r"encoder.language_model.layers\.(?:[^.]+\.)*weight": r"decoder.layers\.\d+\.(?!moe\.)(?:[^.]+\.)*weight",
        "encoder.language_model.embed_tokens.weight": "decoder.embed_tokens.weight"}
ENCODER, DECODER = "model.encoder.language_model.layers.", "model.decoder.layers."


class DiffusionGemma(Gemma4):
    label = "Diffusion Gemma"
    retie = True
    # why zoo.editing.stream refuses it (read where it opens a checkpoint)
    stream_refused = ("Diffusion Gemma's encoder layers run its decoder layers' MoE blocks, which a layer-by-layer "
                      "stream does not hold together")

    def __init__(self):
        GenericFamily.__init__(self, "diffusion_gemma", "image-text-to-text",
                               summary="Diffusion Gemma block-diffusion model (an encoder over the prompt and a "
                                       "decoder denoising a canvas, sharing Gemma 4 MoE layers: softmax top-k routing "
                                       "of an RMS-normed, scaled residual, normed experts beside a dense MLP).",
                               paper="Google, DiffusionGemma model card (google/diffusiongemma-26B-A4B-it)")

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from zoo.architectures.diffusion_gemma_modules import DiffusionGemmaDecoderTextLayer
        from zoo.architectures.gemma4_modules import Gemma4NativeMoe

        self.layers_path, self.block_attr, self.block_class = "decoder.layers", "moe", Gemma4NativeMoe
        pairs = list(zip(base.encoder.language_model.layers, base.decoder.layers))
        if pairs and type(pairs[0][1]) is DiffusionGemmaDecoderTextLayer:  # native layers: checked, then regrouped
            self._regroup(pairs, base.config)
        base._tied_weights_keys = TIES

    def _regroup(self, pairs, config) -> None:
        from zoo.architectures.diffusion_gemma_modules import (DiffusionGemmaZooDecoderLayer,
                                                               DiffusionGemmaZooEncoderLayer)
        from zoo.architectures.gemma4_modules import PARTS, Gemma4NativeMoe

        if not config.tie_word_embeddings:
            raise NotConvertible("Diffusion Gemma with tie_word_embeddings=False: each stack holds MoE tensors of its "
                                 "own, where the zoo holds one block per layer for both")
        for i, (encoder, decoder) in enumerate(pairs):  # (a load builds the model on meta, untied: tied after)
            if any(a is not b and not b.is_meta for p in PARTS
                   for a, b in zip(getattr(encoder, p).parameters(), getattr(decoder, p).parameters())):
                raise NotConvertible(f"Diffusion Gemma layer {i}: the encoder's MoE tensors are not the decoder's "
                                     "(a checkpoint whose stacks differ, which transformers leaves untied)")
        with torch.device("cpu"):  # its norms are probed on real tensors, also while a load builds the model on meta
            self.spec(Gemma4NativeMoe(*(getattr(pairs[0][1], p) for p in PARTS)), config)  # refuses first
        for encoder, decoder in pairs:
            DiffusionGemmaZooDecoderLayer.adopt(decoder)
            DiffusionGemmaZooEncoderLayer.adopt(encoder, decoder)

    # ---- export -----------------------------------------------------------------------------------------------
    def native_copies(self, prefix: str) -> list[str]:
        return [ENCODER + prefix[len(DECODER):]] if prefix.startswith(DECODER) else []
