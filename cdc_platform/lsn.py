"""Log sequence numbers (LSN): PostgreSQL's ``pg_lsn`` text form <-> int.

PostgreSQL prints an LSN as two hexadecimal numbers, the high and the low 32 bits of the
64-bit WAL position, separated by ``/``: ``16/B374D848``. Digits are uppercase and not
zero-padded (``0/0`` is the invalid LSN, ``InvalidXLogRecPtr``).
"""

from __future__ import annotations

import functools
import re

INVALID_LSN = 0
MAX_LSN = 0xFFFF_FFFF_FFFF_FFFF

_LSN_RE = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")


def parse_lsn(text: str) -> int:
    """``"16/B374D848"`` -> ``0x16B374D848``; :class:`ValueError` on anything else."""
    if not isinstance(text, str):
        raise ValueError(  # noqa: TRY004 - one error type for every bad LSN (callers catch it)
            f"an LSN must be text like '16/B374D848', not {type(text).__name__}")
    match = _LSN_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"invalid LSN {text!r}: expected two hexadecimal numbers of at most 8 digits "
            "separated by '/', like '16/B374D848'")
    return (int(match[1], 16) << 32) | int(match[2], 16)


# The commit LSN text of every event of a transaction is the same: consumers parse it once.
parse_lsn_cached = functools.lru_cache(maxsize=256)(parse_lsn)


def format_lsn(lsn: int) -> str:
    """``0x16B374D848`` -> ``"16/B374D848"``, as PostgreSQL prints it."""
    if isinstance(lsn, bool) or not isinstance(lsn, int):
        raise ValueError(  # noqa: TRY004 - one error type for every bad LSN
            f"an LSN must be an int, not {type(lsn).__name__}")
    if not 0 <= lsn <= MAX_LSN:
        raise ValueError(f"LSN {lsn} is outside 0..2**64-1")
    return f"{lsn >> 32:X}/{lsn & 0xFFFF_FFFF:X}"
