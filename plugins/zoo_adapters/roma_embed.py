"""Task embeddings for RoMA's neighbour search.

``wordllama``: WordLlama's ``l2_supercat`` 256-dimensional sentence embedding (a static token-embedding model
trained for sentence similarity, MIT), whose weights ship inside the ``wordllama`` wheel: read from the package's
own folder, never downloaded (the package's loader looks for its tokenizer in a folder it does not ship and would
go to the Hub, so the files are opened here directly). ``hidden``: the model's own last hidden state, averaged
over the sample's tokens.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

EMBEDDINGS = ("wordllama", "hidden")
WORDLLAMA_WEIGHTS = ("weights", "l2_supercat_256.safetensors")
WORDLLAMA_TOKENIZER = ("tokenizers", "l2_supercat_tokenizer_config.json")


def check_embedding(embedding: str) -> None:
    """Raise (one line) unless ``embedding`` can be used here."""
    if embedding not in EMBEDDINGS:
        from zoo.components.options import suggest

        raise ValueError(f"roma: embedding must be one of {', '.join(EMBEDDINGS)}, got {embedding!r}"
                         f"{suggest(str(embedding), EMBEDDINGS)}")
    if embedding == "wordllama":
        wordllama_files()


def wordllama_files() -> tuple[Path, Path]:
    try:
        import wordllama
    except ImportError:
        raise ValueError("roma: embedding='wordllama' needs the wordllama package (pip install wordllama), "
                         "or use embedding='hidden'") from None
    root = Path(wordllama.__file__).parent
    weights, tokenizer = root.joinpath(*WORDLLAMA_WEIGHTS), root.joinpath(*WORDLLAMA_TOKENIZER)
    if not (weights.is_file() and tokenizer.is_file()):
        raise ValueError(f"roma: this wordllama install lacks its shipped model ({weights.name}, {tokenizer.name}); "
                         "use embedding='hidden'")
    return weights, tokenizer


@functools.cache
def wordllama_model():
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from wordllama.inference import WordLlamaInference

    weights, tokenizer = wordllama_files()
    with safe_open(str(weights), framework="np") as f:
        table = f.get_tensor("embedding.weight")
    return WordLlamaInference(table, Tokenizer.from_file(str(tokenizer)), binary=False)


def texts_of(ids: torch.Tensor, tokenizer, attention_mask=None) -> list[str]:
    rows = ids.tolist() if attention_mask is None else [
        [t for t, m in zip(row, mask) if m] for row, mask in zip(ids.tolist(), attention_mask.tolist())]
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def wordllama_embed(texts: list[str]) -> torch.Tensor:
    """[B, 256] L2-normalised sentence embeddings."""
    return torch.from_numpy(wordllama_model().embed(texts, norm=True)).float()


def hidden_embed(last_hidden: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """[B, H]: the last hidden state averaged over each sample's unpadded tokens (no gradient), L2-normalised."""
    h = last_hidden.detach().float()
    m = torch.ones(h.shape[:2]) if attention_mask is None else attention_mask.float()
    m = m.to(h.device)[..., None]
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1)
