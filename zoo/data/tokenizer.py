"""The zoo's byte-level BPE tokenizer, trained on the train splits of the shipped corpus (both domains).

The trained tokenizer ships in ``zoo/_data/tokenizer/``; regenerate it with ``python -m zoo.data.tokenizer build``.
Decoding is lossless: ``tok.decode(tok.encode(text)) == text`` for any text.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from zoo.data.corpus import DOMAINS, SEPARATOR, load_split

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "_data" / "tokenizer"
EOS = SEPARATOR  # bos and eos; documents in a joined split are already separated by it
PAD = "<|pad|>"  # separate from eos so that masking padding never masks a real end of document


def train_tokenizer(vocab_size: int = 8192, corpus_root: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with ``vocab_size`` entries (specials included) on the train splits."""
    # no prefix space and no regex-free shortcuts: ByteLevel then maps every byte reversibly
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = [doc for domain in DOMAINS for doc in load_split(domain, "train", corpus_root)]
    bpe.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The shipped tokenizer (or one saved with ``save_pretrained`` at ``path``)."""
    return PreTrainedTokenizerFast.from_pretrained(str(path or TOKENIZER_DIR))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zoo.data.tokenizer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="train on the shipped corpus and save_pretrained the tokenizer")
    build.add_argument("out_dir", nargs="?", default=str(TOKENIZER_DIR))
    build.add_argument("--vocab-size", type=int, default=8192)
    build.add_argument("--corpus", help="corpus directory (default: the shipped one)")
    args = parser.parse_args(argv)
    tok = train_tokenizer(args.vocab_size, args.corpus)
    tok.save_pretrained(args.out_dir)
    print(f"saved a {len(tok)}-token tokenizer to {args.out_dir}")


if __name__ == "__main__":
    main()
