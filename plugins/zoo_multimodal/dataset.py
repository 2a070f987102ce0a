"""Multimodal digit examples for training and evaluation: features computed once, batches drawn by index.

Each example asks a prompt about one digit shown as an image, spoken as a clip, or both (same digit);
the answer is the digit's word. Images split by image, speech by voice (``zoo_multimodal.digits``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zoo_multimodal import digits as dm

MODES = ("image", "audio", "both")


@dataclass
class Split:
    images: torch.Tensor  # [N, P, patch*patch]
    image_labels: torch.Tensor  # [N]
    audio: dict  # snr (None = clean) -> [M, F, mels]
    audio_labels: torch.Tensor  # [M]


def load_split(processor, split: str, snrs=(), root=None, keys=None) -> Split:
    """Processed images and clips of one split; ``snrs`` adds noisy copies of every clip (seeded per clip)."""
    images, labels = dm.load_images()
    idx = dm.image_split(len(images))[split]
    pix = torch.stack([processor.image_patches(im) for im in images[idx]])
    speech = dm.load_speech(root)
    keys = keys or dm.speech_split(speech, split)
    audio = {None: torch.stack([processor.log_mel(speech[k], dm.SAMPLE_RATE) for k in keys])}
    for snr in snrs:
        audio[snr] = torch.stack([processor.log_mel(dm.add_noise(speech[k], snr, seed=i), dm.SAMPLE_RATE)
                                  for i, k in enumerate(keys)])
    a_labels = torch.tensor([dm.WORDS.index(k.split("|")[-1]) for k in keys])
    return Split(pix, torch.as_tensor(labels[idx]), audio, a_labels)


def batch(processor, split: Split, digits, modes, image_ids=None, audio_ids=None, snr=None, prompts=None,
          answers=True, rng=None):
    """Model inputs for ``digits`` [B] in ``modes`` [B] (each 'image', 'audio' or 'both'). Images and clips
    of the right digit are drawn with ``rng`` unless given."""
    rng = rng or np.random.default_rng(0)
    digits = [int(d) for d in digits]
    if image_ids is None:
        image_ids = [rng.choice(np.flatnonzero(split.image_labels.numpy() == d)) for d in digits]
    if audio_ids is None:
        audio_ids = [rng.choice(np.flatnonzero(split.audio_labels.numpy() == d)) for d in digits]
    prompts = prompts or [dm.PROMPTS[i] for i in rng.integers(len(dm.PROMPTS), size=len(digits))]
    text = processor._text(prompts, [dm.WORDS[d] for d in digits] if answers else None)
    has_image = torch.tensor([m in ("image", "both") for m in modes], dtype=torch.long)
    has_audio = torch.tensor([m in ("audio", "both") for m in modes], dtype=torch.long)
    feats = split.audio[snr] if not isinstance(snr, list) else None
    audio = torch.stack([(split.audio[s][a] if feats is None else feats[a])
                         for a, s in zip(audio_ids, snr if isinstance(snr, list) else [snr] * len(digits))])
    return {**text, "pixel_values": split.images[list(image_ids)] * has_image[:, None, None],
            "image_mask": has_image, "audio_features": audio * has_audio[:, None, None], "audio_mask": has_audio}


def calibration_batches(model, count: int = 4, size: int = 32, seed: int = 0):
    """Default calibration for compressors: ``count`` mixed-modality batches from the train split."""
    from zoo_multimodal.processing_zoo_mm import ZooMMProcessor

    processor = ZooMMProcessor()
    split = load_split(processor, "train")
    rng = np.random.default_rng(seed)
    return [batch(processor, split, rng.integers(10, size=size), [MODES[i % 3] for i in range(size)], rng=rng)
            for _ in range(count)]
