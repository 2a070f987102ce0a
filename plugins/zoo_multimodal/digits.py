"""Multimodal digits, made here from real sources: scikit-learn's bundled 8x8 digit images, spoken digit
words synthesised with Debian's ``espeak-ng`` (several voices, speeds and pitches) and text prompts.

``moe-zoo digits-mm generate OUT`` (or ``python -m zoo_multimodal.digits OUT``) regenerates the set
deterministically: ``OUT/speech.npz`` (int16 waveforms) and ``OUT/manifest.json`` (sha256 of every clip
and of every split). Speech splits by voice (test voices are never heard in training), images split by
image. The shipped ``zoo_multimodal/data/manifest.json`` records the checksums this code produced.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoo.io.atomic import atomic_file, write_text

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TRAIN_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us+f3", "en+m3", "en-us-nyc+f2")
TEST_VOICES = ("en-gb-x-gbclan", "en-gb-x-gbcwmd+f4", "en-us+m7", "en+f1")
SPEEDS = (130, 160, 190)
PITCHES = (35, 50, 70)
PROMPTS = ("which digit ?", "what number is this ?", "name the digit .", "which digit is it ?")
IMAGE_SEED, TEST_FRACTION = 0, 0.2
MANIFEST = Path(__file__).resolve().parent / "data" / "manifest.json"
SAMPLE_RATE = 22050  # espeak-ng's output rate


@dataclass(frozen=True)
class Clip:
    voice: str
    speed: int
    pitch: int
    word: str

    @property
    def key(self) -> str:
        return f"{self.voice}|{self.speed}|{self.pitch}|{self.word}"

    @property
    def label(self) -> int:
        return WORDS.index(self.word)


def clips(voices=TRAIN_VOICES + TEST_VOICES, speeds=SPEEDS, pitches=PITCHES, words=WORDS) -> list[Clip]:
    return [Clip(v, s, p, w) for v in voices for s in speeds for p in pitches for w in words]


def espeak_version() -> str:
    out = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True, check=True).stdout
    return out.split("Data at")[0].strip()


def synthesise(clip: Clip) -> np.ndarray:
    """One clip as int16 samples at 22050 Hz: ``espeak-ng -v VOICE -s SPEED -p PITCH -w out.wav WORD``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.wav")
        subprocess.run(["espeak-ng", "-v", clip.voice, "-s", str(clip.speed), "-p", str(clip.pitch), "-w", path,
                        clip.word], check=True, capture_output=True)
        return read_wav(path)


def read_wav(path_or_bytes) -> np.ndarray:
    """Mono int16 samples of a 16-bit PCM WAV (stdlib ``wave``); the rate must be 22050 Hz."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with wave.open(src) as w:
        if w.getsampwidth() != 2 or w.getframerate() != SAMPLE_RATE:
            raise ValueError(f"expected 16-bit {SAMPLE_RATE} Hz audio, got {w.getsampwidth() * 8}-bit "
                             f"{w.getframerate()} Hz")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return data.reshape(-1, w.getnchannels())[:, 0].copy()


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def split_sha(shas) -> str:
    return hashlib.sha256("".join(sorted(shas)).encode()).hexdigest()


def load_images():
    """scikit-learn's digits: ``images [1797, 8, 8]`` (0..16) and ``labels [1797]``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


def image_split(n: int) -> dict[str, np.ndarray]:
    order = np.random.default_rng(IMAGE_SEED).permutation(n)
    n_test = round(n * TEST_FRACTION)
    return {"train": np.sort(order[n_test:]), "test": np.sort(order[:n_test])}


def generate(out: str | Path | None = None, voices=None, speeds=SPEEDS, pitches=PITCHES, progress=True) -> dict:
    """Synthesise the speech clips, split images and speech, and return (and write, if ``out``) the manifest."""
    from tqdm.auto import tqdm

    chosen = clips(voices or TRAIN_VOICES + TEST_VOICES, speeds, pitches)
    audio = [synthesise(c) for c in tqdm(chosen, desc="espeak-ng", disable=not progress)]
    images, labels = load_images()
    split = image_split(len(images))
    speech = {c.key: sha256(a) for c, a in zip(chosen, audio)}
    manifest = {
        "espeak_ng": espeak_version(), "sample_rate": SAMPLE_RATE, "words": list(WORDS), "prompts": list(PROMPTS),
        "voices": {"train": [v for v in TRAIN_VOICES if any(c.voice == v for c in chosen)],
                   "test": [v for v in TEST_VOICES if any(c.voice == v for c in chosen)]},
        "speeds": list(speeds), "pitches": list(pitches),
        "images": {"source": "sklearn.datasets.load_digits", "count": len(images), "sha256": sha256(images),
                   **{f"{s}_count": len(i) for s, i in split.items()},
                   **{f"{s}_sha256": sha256(np.concatenate([images[i].reshape(-1), labels[i]])) for s, i in
                      split.items()}},
        "speech": {s: split_sha(speech[c.key] for c in chosen if c.voice in vs)
                   for s, vs in (("train", TRAIN_VOICES), ("test", TEST_VOICES))},
        "clips": speech,
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_file(out / "speech.npz", overwrite=True) as staged:  # the generator's own files, replaced whole
            np.savez_compressed(staged, keys=np.array([c.key for c in chosen]),
                                lengths=np.array([len(a) for a in audio]), samples=np.concatenate(audio))
        write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n", overwrite=True)
    return manifest


def default_cache() -> Path:
    return Path(os.environ.get("MOE_ZOO_CACHE", Path.home() / ".cache" / "moe-zoo")) / "digits-mm"


def load_speech(root: str | Path | None = None) -> dict[str, np.ndarray]:
    """``{clip key: int16 samples}``, generating the set into the cache first if it is not there."""
    root = Path(root or default_cache())
    if not (root / "speech.npz").is_file():
        generate(root)
    with np.load(root / "speech.npz") as z:
        keys, lengths, samples = z["keys"], z["lengths"], z["samples"]  # each access decompresses: read once
    ends = np.cumsum(lengths)
    return {str(k): samples[e - n:e] for k, n, e in zip(keys, lengths, ends)}


def speech_split(keys, split: str) -> list[str]:
    voices = TRAIN_VOICES if split == "train" else TEST_VOICES
    return sorted(k for k in keys if k.split("|")[0] in voices)


def add_noise(samples: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """White Gaussian noise at ``snr_db`` (signal power measured over the whole clip); float32 out."""
    x = samples.astype(np.float32)
    power = float(np.mean(x ** 2)) or 1.0
    noise = np.random.default_rng(seed).standard_normal(len(x)).astype(np.float32)
    return x + noise * np.sqrt(power / 10 ** (snr_db / 10))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zoo_multimodal.digits", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(default_cache()))
    parser.add_argument("--check", action="store_true", help="compare with the shipped manifest")
    args = parser.parse_args(argv)
    manifest = generate(args.out)
    print(f"{len(manifest['clips'])} clips, speech train {manifest['speech']['train'][:12]} "
          f"test {manifest['speech']['test'][:12]} -> {args.out}")
    if args.check:
        shipped = json.loads(MANIFEST.read_text())
        same = shipped["clips"] == manifest["clips"] and shipped["images"] == manifest["images"]
        print("matches the shipped manifest" if same else "DIFFERS from the shipped manifest")
        raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
