"""ZooMMProcessor: text prompts, digit images and speech -> ``zoo_mm`` inputs (a transformers ProcessorMixin).

Text: a word-level tokenizer (``<bos> prompt [answer <eos>]``, right-padded). Images: grey, rescaled to
[0, 1] (inverted when the background is light), resized to ``image_size`` and cut into ``patch_size``
patches. Audio: peak-normalised, resampled to ``sampling_rate``, log-mel from ``torch.stft`` and a
triangular mel filterbank built here, silent frames trimmed, pooled to ``audio_frames`` frames and
normalised per utterance. A missing image or clip in a batch is zeros with ``image_mask``/``audio_mask`` 0.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BatchFeature, PreTrainedTokenizerFast, ProcessorMixin

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(words) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the specials and ``words`` (order fixed, so ids are deterministic)."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIALS + list(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def default_tokenizer() -> PreTrainedTokenizerFast:
    from zoo_multimodal.digits import PROMPTS, WORDS

    words = sorted({w for p in PROMPTS for w in p.split()})
    return build_tokenizer(words + list(WORDS))


def mel_filterbank(n_mels: int, n_fft: int, sampling_rate: int, f_min: float = 20.0) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters evenly spaced on the HTK mel scale."""
    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    mels = torch.linspace(mel(f_min), mel(sampling_rate / 2), n_mels + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.linspace(0, sampling_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up, down = (bins - lo) / (mid - lo), (hi - bins) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0).float()


class ZooMMProcessor(ProcessorMixin):
    def __init__(self, tokenizer=None, image_size: int = 8, patch_size: int = 2, sampling_rate: int = 16000,
                 n_fft: int = 400, hop_length: int = 160, num_mel_bins: int = 32, audio_frames: int = 16,
                 trim_db: float = 30.0, **kwargs):
        self.image_size, self.patch_size = image_size, patch_size
        self.sampling_rate, self.n_fft, self.hop_length = sampling_rate, n_fft, hop_length
        self.num_mel_bins, self.audio_frames, self.trim_db = num_mel_bins, audio_frames, trim_db
        super().__init__(tokenizer if tokenizer is not None else default_tokenizer(), **kwargs)

    # ---- text -------------------------------------------------------------------------------------------
    def digit_token_ids(self, words) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(list(words))

    def _text(self, prompts, answers):
        tok = self.tokenizer
        rows, labels = [], []
        for i, prompt in enumerate(prompts):
            ids = [tok.bos_token_id] + tok(prompt, add_special_tokens=False).input_ids
            lab = [-100] * len(ids)
            if answers is not None:
                extra = tok(answers[i], add_special_tokens=False).input_ids + [tok.eos_token_id]
                ids, lab = ids + extra, lab + extra
            rows.append(ids)
            labels.append(lab)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id)
        mask, lab_t = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
        for i, (r, lab) in enumerate(zip(rows, labels)):
            input_ids[i, :len(r)], mask[i, :len(r)], lab_t[i, :len(r)] = torch.tensor(r), 1, torch.tensor(lab)
        out = {"input_ids": input_ids, "attention_mask": mask}
        if answers is not None:
            out["labels"] = lab_t
        return out

    # ---- images -----------------------------------------------------------------------------------------
    def image_patches(self, image) -> torch.Tensor:
        """One image (array, tensor or PIL; grey or RGB[A]) -> [P, patch*patch] in [0, 1]."""
        x = torch.as_tensor(np.asarray(image, dtype=np.float32))
        if x.dim() == 3:  # H, W, C: alpha-weighted grey
            grey = x[..., :3].mean(-1) if x.shape[-1] >= 3 else x[..., 0]
            x = grey * (x[..., 3] / 255.0) + 255.0 * (1 - x[..., 3] / 255.0) if x.shape[-1] == 4 else grey
        x = x - x.min()
        x = x / x.max().clamp(min=1e-6)
        if x.mean() > 0.5:  # dark ink on a light background: make ink bright, as in sklearn's digits
            x = 1 - x
        if x.shape != (self.image_size, self.image_size):
            x = F.interpolate(x[None, None], size=(self.image_size,) * 2, mode="area")[0, 0]
        p = self.patch_size
        return x.unfold(0, p, p).unfold(1, p, p).reshape(-1, p * p)

    # ---- audio ------------------------------------------------------------------------------------------
    def log_mel(self, samples, sampling_rate: int) -> torch.Tensor:
        """A clip (1-D samples, or [n, channels]) -> [audio_frames, num_mel_bins] normalised log-mel."""
        x = torch.as_tensor(np.asarray(samples, dtype=np.float32))
        if x.dim() == 2:
            x = x.mean(-1)
        x = x / x.abs().max().clamp(min=1e-6)
        if sampling_rate != self.sampling_rate:
            n = max(1, round(len(x) * self.sampling_rate / sampling_rate))
            x = F.interpolate(x[None, None], size=n, mode="linear", align_corners=False)[0, 0]
        if len(x) < self.n_fft:
            x = F.pad(x, (0, self.n_fft - len(x)))
        spec = torch.stft(x, self.n_fft, self.hop_length, window=torch.hann_window(self.n_fft), return_complex=True)
        power = spec.abs() ** 2  # [bins, frames]
        mel = mel_filterbank(self.num_mel_bins, self.n_fft, self.sampling_rate) @ power
        logmel = torch.log10(mel + 1e-8) * 10  # dB
        energy = logmel.max(0).values
        loud = (energy > energy.max() - self.trim_db).nonzero().flatten()
        logmel = logmel[:, loud[0]:loud[-1] + 1]  # trim leading and trailing silence
        pooled = F.adaptive_avg_pool1d(logmel[None], self.audio_frames)[0].T  # [frames, mels]
        return (pooled - pooled.mean()) / pooled.std().clamp(min=1e-5)

    # ---- all together -----------------------------------------------------------------------------------
    def __call__(self, text=None, images=None, audio=None, sampling_rate: int = 22050, answers=None,
                 return_tensors="pt", **kwargs) -> BatchFeature:
        """``text``: prompts (str or list); ``images``/``audio``: one per prompt (None where absent), or None."""
        if isinstance(text, str):
            text, images, audio = [text], None if images is None else [images], None if audio is None else [audio]
            answers = None if answers is None else [answers]
        out = self._text(list(text), answers)
        n = len(text)
        if images is not None:
            p = (self.image_size // self.patch_size) ** 2
            pix = [torch.zeros(p, self.patch_size ** 2) if im is None else self.image_patches(im) for im in images]
            out["pixel_values"] = torch.stack(pix)
            out["image_mask"] = torch.tensor([im is not None for im in images], dtype=torch.long)
        if audio is not None:
            rates = sampling_rate if isinstance(sampling_rate, (list, tuple)) else [sampling_rate] * n
            feats = [torch.zeros(self.audio_frames, self.num_mel_bins) if a is None else self.log_mel(a, r)
                     for a, r in zip(audio, rates)]
            out["audio_features"] = torch.stack(feats)
            out["audio_mask"] = torch.tensor([a is not None for a in audio], dtype=torch.long)
        return BatchFeature(out, tensor_type=return_tensors)
