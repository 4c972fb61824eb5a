"""Seeds derived from their parts, so that what a seed drives (a task set, a mini-batch split, one
turn's sampling) depends on what it is for, not on the order or the process that asks."""

from __future__ import annotations

import zlib


def derive_seed(*parts: object) -> int:
    """A seed in [0, 2**32) from ``parts``, the same in every process (unlike ``hash`` of a
    string)."""
    return zlib.crc32(repr(parts).encode())
