"""Wire names of tables: the one token used in subjects, KV keys and partition keys.

A NATS subject token cannot hold ``.``, ``*``, ``>`` or whitespace, and a KV key only
``[-/_=.A-Za-z0-9]``, while a PostgreSQL identifier can hold almost anything. So:

* every character outside ``[A-Za-z0-9_]`` is written ``=XX`` per UTF-8 byte (upper hex);
* a table in schema ``public`` is just its escaped name: ``users``;
* any other table is ``{schema}/{table}``, both escaped: ``sales/orders``.

``/`` never appears inside an escaped part, so the mapping is reversible and unambiguous
(``public/users`` can never be produced, and ``sales/orders`` is never a public table).
"""

from __future__ import annotations

import re

DEFAULT_SCHEMA = "public"
_PLAIN = re.compile(r"[A-Za-z0-9_]")
_ESCAPED = re.compile(r"=([0-9A-F]{2})")
_WIRE_PART = re.compile(r"(?:[A-Za-z0-9_]|=[0-9A-F]{2})+")


def _escape(part: str) -> str:
    return "".join(
        ch if _PLAIN.fullmatch(ch) else "".join(f"={b:02X}" for b in ch.encode())
        for ch in part
    )


def _unescape(part: str) -> str:
    if not _WIRE_PART.fullmatch(part):
        raise ValueError(f"not a wire table name part: {part!r}")
    raw = bytearray()
    index = 0
    while index < len(part):
        if part[index] == "=":
            raw.append(int(part[index + 1 : index + 3], 16))
            index += 3
        else:
            raw += part[index].encode()
            index += 1
    return raw.decode()


def wire_name(schema: str, table: str) -> str:
    """``("public", "users") -> "users"``; ``("sales", "orders") -> "sales/orders"``."""
    if schema == DEFAULT_SCHEMA:
        return _escape(table)
    return f"{_escape(schema)}/{_escape(table)}"


def parse_wire_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`wire_name`; ``ValueError`` on anything it could not have made."""
    schema, sep, table = name.partition("/")
    if not sep:
        return DEFAULT_SCHEMA, _unescape(schema)
    return _unescape(schema), _unescape(table)


def qualified_name(schema: str, table: str) -> str:
    """``schema.table`` for people (logs, KV ``schema`` field); not used on the wire."""
    return f"{schema}.{table}"
