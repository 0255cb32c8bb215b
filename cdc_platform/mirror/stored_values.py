"""A mirrored value read back from SQLite -> the wire value it was stored from, so that a
mirror computes a row's digest (``cdc_platform.wire.digest``) from its own file exactly as the
source computes it from PostgreSQL (docs/verification.md, "What the mirror stores").

``to_sqlite`` changes a value in four ways, each undone here from the column's base type
(``base_type_oid``: a domain's is the type it is over) and whether it holds arrays
(``MirroredColumn.holds_arrays``): an int above 2^63-1 is stored as its decimal text (xid8),
a NaN float as the text ``NaN``, an array as the JSON text of its nested lists (bytes as
``\\x`` hex strings, non-finite floats as ``NaN``/``Infinity``/``-Infinity``), a bool as 0/1
(left as it is: the digest hashes a bool as that integer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from cdc_platform.mirror.columns import (
    NON_FINITE_FLOATS,
    REAL_OIDS,
    WIDE_INTEGER_OIDS,
    MirroredColumn,
)
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire.digest import RowDigester, TableDigest

_FLOAT_ARRAYS = frozenset({1021, 1022})
_BYTEA_ARRAY = 1001


def wire_value(stored: Any, column: MirroredColumn) -> Any:
    """The wire value ``stored`` was written from (a value ``to_sqlite`` did not write, such as
    raw text PostgreSQL printed for a value no converter took, is returned as it is)."""
    if not isinstance(stored, str):
        return stored
    oid = column.base_type_oid
    if oid in REAL_OIDS:
        return math.nan if stored == "NaN" else stored
    if oid in WIDE_INTEGER_OIDS:
        return int(stored) if stored.isascii() and stored.isdigit() else stored
    if column.holds_arrays and stored.startswith("["):
        try:
            items = json.loads(stored)
        except ValueError:
            return stored
        if oid in _FLOAT_ARRAYS:
            return _elements(items, _non_finite)
        if oid == _BYTEA_ARRAY:
            return _elements(items, _hex_bytes)
        return items
    return stored


def _elements(items: list[Any], restore: Callable[[Any], Any]) -> list[Any]:
    return [_elements(item, restore) if isinstance(item, list) else restore(item)
            for item in items]


def _non_finite(item: Any) -> Any:
    return NON_FINITE_FLOATS.get(item, item) if isinstance(item, str) else item


def _hex_bytes(item: Any) -> Any:
    if isinstance(item, str) and item.startswith("\\x"):
        return bytes.fromhex(item[2:])
    return item


class StoredRowDigester:
    """Key and row hashes of rows read from a mirror's SQLite table: ``SELECT`` of
    ``columns`` (in that order) gives tuples whose values ``wire_value`` turns back into the
    wire values the digest is defined over."""

    def __init__(self, columns: Sequence[MirroredColumn], key_columns: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self.names = tuple(column.name for column in columns)
        self._digester = RowDigester(self.names, key_columns)

    def hashes(self, stored: Sequence[Any]) -> tuple[int, int]:
        """``(key_hash, row_hash)`` of one stored row (a tuple in ``columns`` order)."""
        if len(stored) != len(self.columns):
            raise ValueError(f"{len(self.columns)} values expected, not {len(stored)}")
        return self._digester.hashes_of_values([
            wire_value(value, column) for column, value in zip(self.columns, stored)])


def digest_stored_rows(digest: TableDigest, digester: StoredRowDigester,
                       rows: Iterable[Sequence[Any]]) -> int:
    """Add stored rows (``digester.columns`` order) to ``digest``; the number added."""
    added = 0
    for stored in rows:
        digest.add(*digester.hashes(stored))
        added += 1
    return added


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.mirror import stored_values as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    wire_value = _twin.wire_value
    StoredRowDigester = _twin.StoredRowDigester  # type: ignore[misc]
    digest_stored_rows = _twin.digest_stored_rows
