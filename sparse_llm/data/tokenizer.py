"""Tokenizer loading: the shipped embedded BPE, a local directory, or a hub id."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

EMBEDDED_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(spec: str) -> PreTrainedTokenizerFast:
    """Load "embedded", a local directory, or a hub id as a fast tokenizer that has an EOS token."""
    if spec == "embedded":
        if not (EMBEDDED_TOKENIZER_DIR / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"embedded tokenizer missing at {EMBEDDED_TOKENIZER_DIR}; run scripts/train_tokenizer.py"
            )
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(EMBEDDED_TOKENIZER_DIR))
    else:
        local = Path(spec).expanduser()
        if spec.startswith((".", "/", "~")) and not local.exists():
            raise FileNotFoundError(f"data.tokenizer: no tokenizer directory at {spec!r}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else spec, use_fast=True)
        except (OSError, ValueError) as err:  # not a tokenizer dir, unknown hub id, or offline
            raise FileNotFoundError(
                f"data.tokenizer: cannot load tokenizer {spec!r} (not a tokenizer directory, "
                f"and not loadable from the Hugging Face hub): {err}"
            ) from err
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(
            f"data.tokenizer: {spec!r} has no fast (Rust) tokenizer; got {type(tokenizer).__name__}"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(f"data.tokenizer: {spec!r} has no EOS token, which separates packed documents")
    return tokenizer
