"""The mirrored columns: the SQLite type each PostgreSQL type is stored as, a wire value as
SQLite binds it, and a table's shape (its columns and key) as the KV schema gives it.

Local tables are named by the wire table name (``users``, ``sales/orders``), columns by their
PostgreSQL names. Column types follow the wire type mapping (docs/mirror.md):

=====================================  ===========  ===================================
PostgreSQL                             SQLite type  stored value
=====================================  ===========  ===================================
int2, int4, int8, oid, xid, cid        INTEGER      int
bool                                   INTEGER      0 / 1
xid8                                   (none)       int; above 2^63-1 its decimal text (INTEGER
                                                    affinity would turn that text into a lossy
                                                    real)
float4, float8                         (none)       float, -0.0 included (REAL affinity would
                                                    store -0.0 as 0); NaN as the text ``NaN``
                                                    (SQLite stores a NaN real as NULL)
bytea                                  BLOB         bytes
every other builtin type               TEXT         the wire string (numeric exact, ISO dates,
                                                    json/jsonb text, ...)
arrays                                 TEXT         JSON text of the nested lists (bytes as
                                                    ``\\x`` hex strings, NaN as ``"NaN"``)
domains, enums, extension types        (none)       the wire value as it is (no affinity,
                                                    so nothing is converted)
=====================================  ===========  ===================================

The declared type follows the column's own type (``type_oid``), so a domain's column has no
affinity; what its values need (a NaN's text, an xid8's digits, an array's JSON, JSON's
base64 and non-finite floats) follows its base type (``base_type_oid``), and whether they
are arrays the schema's ``is_array`` (a domain over ``mood[]``: its base type is no builtin).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdc_platform.mirror.errors import MirrorError
from cdc_platform.wire import Column

_BOOL_OID = 16
_INTEGER_OIDS = frozenset({20, 21, 23, 26, 28, 29, _BOOL_OID})
WIDE_INTEGER_OIDS = frozenset({5069})  # xid8: up to 2^64-1, past SQLite's int64
REAL_OIDS = frozenset({700, 701})
_BLOB_OIDS = frozenset({17})
# Builtin types whose wire value is always a str (values.py): TEXT affinity keeps it as is.
_TEXT_OIDS = frozenset({
    18, 19, 25, 114, 142, 600, 601, 602, 603, 604, 628, 650, 718, 774, 790, 829, 869, 1042,
    1043, 1082, 1083, 1114, 1184, 1186, 1266, 1560, 1562, 1700, 2950, 3220, 3614, 3615, 3802,
    4072, 3904, 3906, 3908, 3910, 3912, 3926, 2205, 2206, 24, 27, 1033, 1790,
})
# The builtin array types (protocol/values.py knows them too): a domain over one has no
# affinity, yet holds the JSON text of an array.
BUILTIN_ARRAY_OIDS = frozenset({
    1000, 1001, 1002, 1003, 1016, 1005, 1007, 1009, 1028, 1011, 1012, 199, 143, 1017, 1018,
    1019, 1020, 1027, 629, 651, 1021, 1022, 719, 775, 791, 1040, 1041, 1014, 1015, 1182, 1183,
    1115, 1185, 1187, 1270, 1561, 1563, 1231, 2951, 3221, 3643, 3645, 3807, 4073, 3905, 3907,
    3909, 3911, 3913, 3927, 271, 2210, 2211, 1008, 1010, 1034, 2201,
})
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def sqlite_type(type_oid: int, data_type: str) -> str:
    """The declared SQLite type of a column (see the module docstring)."""
    if data_type.endswith("[]"):
        return "TEXT"
    if type_oid in _INTEGER_OIDS:
        return "INTEGER"
    if type_oid in WIDE_INTEGER_OIDS:
        return ""  # an int, or its text past int64: no affinity may touch it
    if type_oid in REAL_OIDS:
        return ""  # REAL affinity stores -0.0 as the integer 0: its sign would be lost
    if type_oid in _BLOB_OIDS:
        return "BLOB"
    if type_oid in _TEXT_OIDS:
        return "TEXT"
    return ""  # no affinity: stored exactly as the wire value


def _json_value(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    return value


def to_sqlite(value: Any) -> Any:
    """A wire value -> the value bound to SQLite (see the module docstring)."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else value
    if isinstance(value, (list, dict)):
        return json.dumps(_json_value(value), separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise MirrorError(f"no SQLite mapping for a {type(value).__name__} value")


_AS_IS_OIDS = _INTEGER_OIDS | _BLOB_OIDS | _TEXT_OIDS


def quote(identifier: str) -> str:
    """An SQLite identifier, quoted (any name PostgreSQL allows)."""
    return '"' + identifier.replace('"', '""') + '"'


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def sqlite_folded(identifier: str) -> str:
    """What SQLite compares of ``identifier``: its names ignore ASCII case, quoted or not
    (``"Users"`` and ``users`` are one table, ``"Z"`` and ``z`` one column), while
    PostgreSQL's quoted names do not; other letters are kept as they are."""
    return identifier.translate(_ASCII_LOWER)


def insert_statement(table: str, names: Sequence[str]) -> str:
    """An INSERT of ``names`` into ``table``, one parameter per name."""
    return (f"INSERT INTO {quote(table)} ({', '.join(quote(n) for n in names)}) "
            f"VALUES ({', '.join('?' * len(names))})")


# JSON payloads carry bytea as base64 and non-finite floats as strings (docs/wire-contract.md
# "Payload encoding"): the columns whose values a JSON consumer must turn back, by base type.
_JSON_BYTES_OIDS = frozenset({17, 1001})  # bytea, bytea[]
_JSON_FLOAT_OIDS = frozenset({700, 701, 1021, 1022})  # float4/8 and their arrays
NON_FINITE_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _from_base64(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_base64(item) for item in value]
    return base64.b64decode(value) if isinstance(value, str) else value


def _from_json_float(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json_float(item) for item in value]
    return NON_FINITE_FLOATS[value] if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class MirroredColumn:
    """A source column as the mirror stores it: the wire column and its SQLite type."""

    column: Column
    sqlite_type: str
    # copied from ``column``: the apply and digest paths read them per value, and properties
    # made the mirror's digest of its rows (stored_values.wire_value) ~10% slower
    name: str = field(init=False)
    type_oid: int = field(init=False)
    base_type_oid: int = field(init=False)  # what its values are: a domain's base type
    attnum: int = field(init=False)  # the source column's identity, kept by a RENAME (0: not known)
    is_primary_key: bool = field(init=False)
    # its values are arrays, stored as their JSON text: the schema says so (``is_array``), or,
    # where a schema written before that field does not, its base type is a builtin array
    # type (a domain over one has no affinity) or ``sqlite_type`` declared it TEXT for an
    # array (it declares TEXT for arrays and the builtin text types, so a TEXT column whose
    # type alone is not TEXT holds arrays)
    holds_arrays: bool = field(init=False)

    def __post_init__(self) -> None:
        for name in ("name", "type_oid", "base_type_oid", "attnum", "is_primary_key"):
            object.__setattr__(self, name, getattr(self.column, name))
        object.__setattr__(self, "holds_arrays", self.column.is_array
                           or self.base_type_oid in BUILTIN_ARRAY_OIDS
                           or (self.sqlite_type == "TEXT"
                               and sqlite_type(self.type_oid, "") != "TEXT"))

    @property
    def bound_as_is(self) -> bool:
        """Whether the column's wire values are bound to SQLite unconverted (str, int, bytes,
        bool, None): no float (NaN), no array (lists), no unknown type."""
        return self.base_type_oid in _AS_IS_OIDS

    @property
    def is_float(self) -> bool:
        return self.base_type_oid in REAL_OIDS

    @property
    def is_bool(self) -> bool:
        return self.base_type_oid == _BOOL_OID


def _stored_column(position: int, name: str, declared: str, is_primary_key: bool,
                   type_oid: int = 0, attnum: int = 0, base_type_oid: int = 0,
                   is_array: bool = False) -> MirroredColumn:
    """A column as :meth:`TableShape.to_json_text` keeps it (files written before type_oid,
    attnum, base_type_oid and is_array were kept: 0, not known; the base type then is the
    type; not known to be an array)."""
    return MirroredColumn(Column(name, position, "", True, None, type_oid, False,
                                 is_primary_key, attnum=attnum, base_type_oid=base_type_oid,
                                 is_array=bool(is_array)),
                          declared)


@dataclass(frozen=True)
class TableShape:
    """What the store needs of a KV ``schemas`` value."""

    table: str  # wire name
    fingerprint: str
    columns: tuple[MirroredColumn, ...]

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any]) -> TableShape:
        table = schema.get("table") if isinstance(schema, Mapping) else None
        try:
            primary_key = set(schema.get("primary_key") or ())
            raw_columns = schema["columns"]
            if not isinstance(raw_columns, list) or not raw_columns:
                raise ValueError("no columns")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MirrorError(f"schema of {table!r} is not a valid schemas value: {exc!r}") \
                from exc
        columns = []
        for position, raw in enumerate(raw_columns, start=1):
            try:
                column = Column.from_wire(raw)
                # the key the mirror keeps is the schema's primary_key, whatever the columns say
                column = dataclasses.replace(column,
                                             is_primary_key=column.name in primary_key)
                columns.append(MirroredColumn(column,
                                              sqlite_type(column.type_oid, column.data_type)))
            except (KeyError, TypeError, ValueError) as exc:
                shown = raw.get("name") if isinstance(raw, Mapping) else raw
                raise MirrorError(f"schema of {table!r}: column {position} ({shown!r}) cannot "
                                  f"be mapped to SQLite: {exc!r}") from exc
        if len({c.name for c in columns}) != len(columns):
            raise MirrorError(f"schema of {table!r} names a column twice")
        folded: dict[str, str] = {}
        for name in (c.name for c in columns):
            other = folded.setdefault(sqlite_folded(name), name)
            if other != name:
                raise MirrorError(
                    f"{table}: columns {other!r} and {name!r} differ only in case, "
                    "and SQLite's names ignore case: this table cannot be mirrored into "
                    "SQLite while it has both (rename one in PostgreSQL)")
        if not primary_key <= {c.name for c in columns}:
            raise MirrorError(f"schema of {table!r}: primary key {sorted(primary_key)} names "
                              "a column it does not have")
        return cls(str(table), str(schema.get("fingerprint")), tuple(columns))

    def to_json_text(self) -> str:
        """The shape as the mirror's bookkeeping keeps it: per column what the mirror reads
        back (the form is stable: files written by earlier versions read it)."""
        return json.dumps({"table": self.table, "fingerprint": self.fingerprint,
                           "columns": [[c.name, c.sqlite_type, c.is_primary_key, c.type_oid,
                                        c.attnum, c.base_type_oid, c.column.is_array]
                                       for c in self.columns]})

    @classmethod
    def from_json_text(cls, text: str) -> TableShape:
        """The shape :meth:`to_json_text` wrote; ValueError, KeyError or TypeError for text
        it did not write. The columns' other wire fields were not kept: they read as unknown
        (``Column.from_wire``'s defaults; data_type empty)."""
        data = json.loads(text)
        return cls(data["table"], data["fingerprint"], tuple(
            _stored_column(position, *column)
            for position, column in enumerate(data["columns"], start=1)))

    def learning_base_types(self, other: TableShape) -> TableShape:
        """This shape with what ``other`` (the same table's, a snapshot's) says of the values
        of the columns it kept nothing for: their base types (a shape kept before base types
        were: domains as themselves) and that they are arrays (kept before ``is_array`` was:
        a domain over an array of a non-builtin type as text); this shape itself when there
        is nothing to learn."""
        theirs = {column.name: column.column for column in other.columns}
        learned = {}
        for column in self.columns:
            their = theirs.get(column.name)
            if their is None:
                continue
            base = (their.base_type_oid if column.base_type_oid == column.type_oid
                    else column.base_type_oid)
            is_array = column.column.is_array or their.is_array
            if (base, is_array) != (column.base_type_oid, column.column.is_array):
                learned[column.name] = dataclasses.replace(column.column, base_type_oid=base,
                                                           is_array=is_array)
        if not learned:
            return self
        return dataclasses.replace(self, columns=tuple(
            MirroredColumn(learned[column.name], column.sqlite_type)
            if column.name in learned else column for column in self.columns))

    @functools.cached_property
    def key_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.is_primary_key]

    def from_json(self, row: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A row map of a JSON payload with its bytea and non-finite float values restored
        (a msgpack payload carries them natively)."""
        if row is None:
            return None
        restored = dict(row)
        for column in self.columns:
            value = restored.get(column.name)
            if value is None:
                continue
            if column.base_type_oid in _JSON_BYTES_OIDS:
                restored[column.name] = _from_base64(value)
            elif column.base_type_oid in _JSON_FLOAT_OIDS:
                restored[column.name] = _from_json_float(value)
        return restored

