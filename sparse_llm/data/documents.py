"""What counts as a usable document, and which split (train / val) it belongs to."""

from __future__ import annotations

import hashlib
from typing import Any

SPLITS = ("train", "val")
USABLE, EMPTY, MALFORMED = "usable", "empty", "malformed"


def classify(example: dict[str, Any], text_field: str) -> tuple[str, str | None]:
    """Return (kind, text): malformed if the field is missing or not a string, empty if blank."""
    text = example.get(text_field)
    if not isinstance(text, str):
        return MALFORMED, None
    if not text.strip():
        return EMPTY, None
    return USABLE, text


def split_of(text: str, val_fraction: float) -> str:
    """Assign a document by a stable hash of its content.

    The hash (not the position) decides, so the split is the same for any rank count, order or
    machine, and identical documents always land on the same side.
    """
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "big") < val_fraction * 2**64 else "train"
