"""Train the embedded tokenizer: byte-level BPE, vocabulary 4096, on the stdlib's .py sources.

The result is shipped in sparse_llm/assets/tokenizer/ so that no run needs a download; re-run
this only to change the tokenizer (every model trained with the old one becomes incompatible).

    python scripts/train_tokenizer.py [--vocab-size 4096] [--out sparse_llm/assets/tokenizer]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sparse_llm.data.documents import USABLE, classify, split_of
from sparse_llm.data.sources import EMBEDDED_TEXT_FIELD, stdlib_files
from sparse_llm.data.tokenizer import EMBEDDED_TOKENIZER_DIR, EOS_TOKEN

# Documents hashed below this are left out of training. Splits are monotone in the fraction, so
# every validation set with data.val_fraction <= HOLDOUT stays unseen by the tokenizer too.
HOLDOUT = 0.02


def training_texts(val_fraction: float) -> Iterator[str]:
    """Usable train-split stdlib documents: the validation documents stay unseen."""
    for path in stdlib_files():
        try:
            example = {EMBEDDED_TEXT_FIELD: path.read_bytes().decode("utf-8")}
        except UnicodeDecodeError:
            continue
        kind, text = classify(example, EMBEDDED_TEXT_FIELD)
        if kind == USABLE and split_of(text, val_fraction) == "train":
            yield text


def train(vocab_size: int, val_fraction: float) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown token
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(training_texts(val_fraction), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--val-fraction", type=float, default=HOLDOUT)
    parser.add_argument("--out", type=Path, default=EMBEDDED_TOKENIZER_DIR)
    args = parser.parse_args()
    tokenizer = train(args.vocab_size, args.val_fraction)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(args.out))
    print(f"saved a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
