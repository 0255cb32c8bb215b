"""PostgreSQL ``COPY ... TO STDOUT`` text format -> per-column ``str | None``.

Rows end with ``\\n``; columns are separated by ``\\t``; ``\\N`` is NULL; inside a value a
backslash escapes ``\\b \\f \\n \\r \\t \\v \\\\``, ``\\NNN`` (octal) and ``\\xHH`` (hex).
The values are then what the type output functions printed, as pgoutput sends them, so the
same converters apply (``cdc_platform.protocol.values``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from cdc_platform.errors import ConversionError

_SIMPLE_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "\\": "\\"}
_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|(.))", re.DOTALL)


def _replace(match: re.Match[str]) -> str:
    octal, hexa, other = match.groups()
    if octal is not None:
        return chr(int(octal, 8))
    if hexa is not None:
        return chr(int(hexa, 16))
    return _SIMPLE_ESCAPES.get(other, other)


def unescape(field: str) -> str:
    """Undo COPY text escaping in one field (which is not ``\\N``)."""
    return _ESCAPE.sub(_replace, field) if "\\" in field else field


def parse_line(line: str) -> Sequence[str | None]:
    """One COPY text row (without its newline) -> column texts, None for NULL."""
    if "\\" not in line:
        return line.split("\t")
    return [None if field == "\\N" else unescape(field) for field in line.split("\t")]


def iter_rows(text: str) -> Iterator[Sequence[str | None]]:
    """Every row of a block of complete COPY text lines (the block ends with ``\\n``)."""
    if text and not text.endswith("\n"):
        raise ConversionError("COPY text block does not end at a row boundary")
    for line in text.split("\n")[:-1]:
        yield parse_line(line)
