"""Typed values: PostgreSQL's text output -> Python (and so msgpack/JSON) values.

One converter serves CDC (pgoutput text columns) and snapshots (``COPY ... TO STDOUT`` text),
so a consumer sees the same value for the same cell whichever path delivered it. The text is
what the type's output function prints on a session with :data:`REQUIRED_SESSION_SETTINGS`
(the replication and snapshot connections set them).

======================================  ==========================================================
PostgreSQL type                         value
======================================  ==========================================================
int2, int4, int8, oid, xid, xid8, cid   int
float4, float8                          float (NaN, Infinity, -Infinity included)
numeric                                 str, exact as printed ("12.50", "NaN", "Infinity")
bool                                    bool
text, varchar, bpchar, char, name,      str (bpchar keeps its padding)
citext, uuid, enums
json, jsonb                             str: the JSON text exactly as printed (numbers of any
                                        size or precision, json's whitespace, key order and
                                        duplicate keys kept; jsonb 'null' is "null", SQL
                                        NULL is None)
arrays of any element type              nested lists; NULL elements -> None; lower bounds dropped
date                                    "2025-12-08"
timestamp                               "2025-12-08T13:45:21.719719"
timestamptz                             "2025-12-08T13:45:21.719719Z" (UTC)
time                                    "13:45:21.719719"
timetz                                  "13:45:21.719719+02:00"
  infinity / -infinity                  "infinity" / "-infinity"
  BC dates                              ISO-8601 astronomical numbering: 1 BC is year 0
                                        (0001-12-31 BC -> "0000-12-31"), 4713-11-24 BC ->
                                        "-4712-11-24"; years after 9999 as printed
                                        ("294276-12-31"), without a sign
interval                                ISO-8601 duration as printed: "P1Y2M3DT4H5M6.5S"
bytea                                   bytes (JSON wire: base64 string)
inet, cidr, macaddr, macaddr8, money,   str, as printed
bit, varbit, xml, ranges, geometric,
tsvector, composites, pg_lsn, ...
domains                                 the value of their base type
unknown / extension types (hstore...)   str, as printed: never an error
======================================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc_platform.errors import ConversionError
from cdc_platform.speedups import compiled_twin

REQUIRED_SESSION_SETTINGS = {
    "DateStyle": "ISO, YMD",
    "TimeZone": "UTC",
    "IntervalStyle": "iso_8601",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "client_encoding": "UTF8",
}

TYPE_CATALOG_QUERY = """
SELECT t.oid::int, t.typname, n.nspname, t.typtype, t.typcategory, t.typelem::int,
       t.typbasetype::int, t.typdelim, t.typarray::int
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid = ANY(%s::oid[])
"""

Converter = Callable[[str], Any]


# -- scalar converters ------------------------------------------------------------------------
def _bool(text: str) -> bool:
    return text == "t"


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise ConversionError("bytea not in hex format (set bytea_output=hex)")


def _bc_year(date_part: str) -> str:
    """``0044-03-15`` of a BC date -> ``-0043-03-15``; ``0001-12-31`` -> ``0000-12-31``:
    astronomical numbering, in which 1 BC is year 0 (ISO 8601 has no ``-0000``)."""
    year, rest = date_part.split("-", 1)
    astronomical = 1 - int(year)
    sign = "-" if astronomical < 0 else ""
    return f"{sign}{abs(astronomical):04d}-{rest}"


def _date(text: str) -> str:
    if text.endswith(" BC"):
        return _bc_year(text[:-3])
    return text


def _timestamp(text: str) -> str:
    """``2025-12-08 13:45:21.5`` -> ``2025-12-08T13:45:21.5``."""
    if text.endswith(" BC"):
        date_part, time_part = text[:-3].split(" ", 1)
        return f"{_bc_year(date_part)}T{time_part}"
    if text[-1] == "y":  # infinity, -infinity
        return text
    return text.replace(" ", "T", 1)


def timestamptz_python(text: str) -> str:
    """With TimeZone=UTC: ``2025-12-08 13:45:21.5+00`` -> ``2025-12-08T13:45:21.5Z``."""
    bc = text.endswith(" BC")
    if bc:
        text = text[:-3]
    elif text[-1] == "y":
        return text
    if text.endswith("+00"):
        text = text[:-3] + "Z"
    else:  # a session not in UTC: keep the offset, ISO style
        text = _iso_offset(text)
    date_part, time_part = text.split(" ", 1)
    if bc:
        date_part = _bc_year(date_part)
    return f"{date_part}T{time_part}"


def _iso_offset(text: str) -> str:
    """``...+02`` -> ``...+02:00``; ``+05:30`` stays; ``+01:02:03`` stays."""
    for index in range(len(text) - 1, 0, -1):
        if text[index] in "+-":
            offset = text[index:]
            if len(offset) == 3:
                return f"{text[:index]}{offset}:00"
            return text
    return text


def _timetz(text: str) -> str:
    return _iso_offset(text)


def identity(text: str) -> str:
    """The converter of text-like types: the text is the value (callers may skip it)."""
    return text


#: ``timestamptz_python``, or its compiled twin (the same results).
timestamptz: Callable[[str], str] = timestamptz_python

# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub. (Here, not at the end: the converter tables below hold them.)
if TYPE_CHECKING:
    from cdc_platform._speedups.protocol import values as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    timestamptz = _twin.timestamptz

#: Converters that return the text itself: row builders and packers skip the call.
TEXT_CONVERTERS = frozenset((str, identity))


_SCALARS: dict[int, Converter] = {
    16: _bool,
    17: _bytea,
    20: int, 21: int, 23: int, 26: int, 28: int, 29: int, 5069: int,  # int8/2/4, oid, xid, cid
    700: float, 701: float,
    1700: identity,  # numeric: exact text
    # json/jsonb: the exact text; parsing could not be lossless (numbers beyond 64 bits or
    # float64, json's duplicate keys) and msgpack has no integer above 64 bits
    114: identity, 3802: identity,
    1082: _date, 1083: identity,
    1114: _timestamp,
    1184: timestamptz,
    1266: _timetz,
    1186: identity,  # interval, as printed with IntervalStyle=iso_8601
}

_BUILTIN_NAMES: dict[int, str] = {
    16: "boolean", 17: "bytea", 18: "\"char\"", 19: "name", 20: "bigint", 21: "smallint",
    23: "integer", 25: "text", 26: "oid", 28: "xid", 29: "cid", 114: "json", 142: "xml",
    600: "point", 601: "lseg", 602: "path", 603: "box", 604: "polygon", 628: "line",
    650: "cidr", 700: "real", 701: "double precision", 718: "circle", 774: "macaddr8",
    790: "money", 829: "macaddr", 869: "inet", 1042: "character", 1043: "character varying",
    1082: "date", 1083: "time without time zone", 1114: "timestamp without time zone",
    1184: "timestamp with time zone", 1186: "interval", 1266: "time with time zone",
    1560: "bit", 1562: "bit varying", 1700: "numeric", 2950: "uuid", 3220: "pg_lsn",
    3614: "tsvector", 3615: "tsquery", 3802: "jsonb", 4072: "jsonpath", 3904: "int4range",
    3906: "numrange", 3908: "tsrange", 3910: "tstzrange", 3912: "daterange",
    3926: "int8range", 5069: "xid8", 2205: "regclass", 2206: "regtype", 24: "regproc",
    27: "tid", 1033: "aclitem", 1790: "refcursor",
}

# array type oid -> element type oid (builtin types)
_BUILTIN_ARRAYS: dict[int, int] = {
    1000: 16, 1001: 17, 1002: 18, 1003: 19, 1016: 20, 1005: 21, 1007: 23, 1009: 25,
    1028: 26, 1011: 28, 1012: 29, 199: 114, 143: 142, 1017: 600, 1018: 601, 1019: 602,
    1020: 603, 1027: 604, 629: 628, 651: 650, 1021: 700, 1022: 701, 719: 718, 775: 774,
    791: 790, 1040: 829, 1041: 869, 1014: 1042, 1015: 1043, 1182: 1082, 1183: 1083,
    1115: 1114, 1185: 1184, 1187: 1186, 1270: 1266, 1561: 1560, 1563: 1562, 1231: 1700,
    2951: 2950, 3221: 3220, 3643: 3614, 3645: 3615, 3807: 3802, 4073: 4072, 3905: 3904,
    3907: 3906, 3909: 3908, 3911: 3910, 3913: 3912, 3927: 3926, 271: 5069, 2210: 2205,
    2211: 2206, 1008: 24, 1010: 27, 1034: 1033, 2201: 1790,
}
_BUILTIN_ARRAY_OF = {element: array for array, element in _BUILTIN_ARRAYS.items()}
_BOX_OID = 603


# -- arrays --------------------------------------------------------------------------------------
def parse_array(text: str, convert: Converter = identity, delimiter: str = ",") -> list[Any]:
    """A PostgreSQL array literal as printed by ``array_out`` -> nested lists.

    Quoted elements may contain the delimiter, braces, ``"`` and ``\\`` (backslash-escaped);
    unquoted ``NULL`` is NULL while quoted ``"NULL"`` is the string. A ``[lo:hi]=`` prefix
    (non-default lower bounds) is dropped: consumers get plain lists.
    """
    if not text:
        raise ConversionError("empty array literal")
    start = text.find("=") + 1 if text[0] == "[" else 0
    if start >= len(text) or text[start] != "{":
        raise ConversionError(f"not an array literal: {text[:40]!r}")
    try:
        value, end = _parse_level(text, start, convert, delimiter)
    except (IndexError, ValueError) as exc:
        raise ConversionError(f"malformed array literal {text[:60]!r}") from exc
    if end != len(text):
        raise ConversionError(f"trailing text after array literal {text[:60]!r}")
    return value


def _parse_level(text: str, pos: int, convert: Converter, delimiter: str
                 ) -> tuple[list[Any], int]:
    result: list[Any] = []
    value: Any
    pos += 1  # the "{"
    if text[pos] == "}":
        return result, pos + 1
    find = text.find
    while True:
        char = text[pos]
        if char == "{":
            value, pos = _parse_level(text, pos, convert, delimiter)
        elif char == '"':
            pos += 1
            pieces = []
            while True:
                quote = find('"', pos)
                backslash = find("\\", pos, quote)
                if backslash < 0:
                    pieces.append(text[pos:quote])
                    pos = quote + 1
                    break
                pieces.append(text[pos:backslash])
                pieces.append(text[backslash + 1])
                pos = backslash + 2
            value = convert("".join(pieces))
        else:
            end_delim = find(delimiter, pos)
            end_brace = find("}", pos)
            end = end_brace if end_delim < 0 or end_brace < end_delim else end_delim
            token = text[pos:end]
            value = None if token == "NULL" else convert(token)
            pos = end
        result.append(value)
        char = text[pos]
        if char == delimiter:
            pos += 1
        elif char == "}":
            return result, pos + 1
        else:
            raise ValueError(f"unexpected {char!r} at {pos}")


def _array_converter(element: Converter, delimiter: str) -> Converter:
    if element is identity and delimiter == ",":
        return parse_array
    return lambda text: parse_array(text, element, delimiter)


# -- the registry ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TypeInfo:
    """A ``pg_type`` row, for types that are not builtin."""

    oid: int
    name: str
    namespace: str
    kind: str  # typtype: b base, c composite, d domain, e enum, p pseudo, r range, m multirange
    category: str  # typcategory: A array, ...
    element_oid: int  # typelem (arrays)
    base_oid: int  # typbasetype (domains)
    delimiter: str
    array_oid: int  # typarray: the type of its arrays (0: none)


class TypeRegistry:
    """Knows every builtin type; learns the others from the catalog (see the I/O layer)."""

    def __init__(self) -> None:
        self._catalog: dict[int, TypeInfo] = {}
        self._converters: dict[int, Converter] = {}

    # catalog look-ups --------------------------------------------------------------------
    def missing_oids(self, oids: Iterable[int]) -> set[int]:
        """Type OIDs (and the element/base types they refer to) we still need rows for."""
        missing: set[int] = set()
        pending = list(oids)
        seen: set[int] = set()
        while pending:
            oid = pending.pop()
            if oid in seen or oid == 0:
                continue
            seen.add(oid)
            if self._is_builtin(oid):
                continue
            info = self._catalog.get(oid)
            if info is None:
                missing.add(oid)
                continue
            if info.category == "A" and info.element_oid:
                pending.append(info.element_oid)
            if info.kind == "d" and info.base_oid:
                pending.append(info.base_oid)
        return missing

    def add_catalog_rows(self, rows: Iterable[Sequence[Any]]) -> None:
        for oid, name, namespace, kind, category, element, base, delimiter, array in rows:
            self._catalog[int(oid)] = TypeInfo(int(oid), name, namespace, kind, category,
                                               int(element or 0), int(base or 0), delimiter,
                                               int(array or 0))
        self._converters.clear()  # a domain/array may now resolve to something better

    def _is_builtin(self, oid: int) -> bool:
        return oid in _SCALARS or oid in _BUILTIN_NAMES or oid in _BUILTIN_ARRAYS

    # converters ------------------------------------------------------------------------------
    def converter(self, oid: int) -> Converter:
        found = self._converters.get(oid)
        if found is None:
            found = self._converters[oid] = self._build(oid, depth=0)
        return found

    def _build(self, oid: int, depth: int) -> Converter:
        if depth > 16:  # a domain over a domain over ...: give up on typing, keep the text
            return identity
        scalar = _SCALARS.get(oid)
        if scalar is not None:
            return scalar
        element = _BUILTIN_ARRAYS.get(oid)
        if element is not None:
            return _array_converter(self._build(element, depth + 1),
                                    ";" if element == _BOX_OID else ",")
        info = self._catalog.get(oid)
        if info is None:
            return identity  # text types, unknown and extension types: the text itself
        if info.kind == "d" and info.base_oid:
            return self._build(info.base_oid, depth + 1)
        if info.category == "A" and info.element_oid:
            element_info = self._catalog.get(info.element_oid)
            delimiter = element_info.delimiter if element_info else ","
            return _array_converter(self._build(info.element_oid, depth + 1), delimiter)
        return identity  # enums, composites, ranges, extension base types

    def base_type_oid(self, oid: int) -> int:
        """The type whose values ``oid``'s are (KV ``schemas``' ``base_type_oid``): ``oid``
        with domains resolved as :meth:`converter` resolves them, and an array's element
        too (an array of a domain: the array type of the domain's base; of a domain over an
        array: that array type, PostgreSQL's arrays having any number of dimensions). A type
        the registry does not know, or an array whose resolved element has no array type, is
        itself."""
        resolved = self._resolve_domain(oid, depth=0)
        element = self._element_of(resolved)
        if not element:
            return resolved
        base_element = self.base_type_oid(element)
        if base_element == element:
            return resolved
        if self._element_of(base_element):
            return base_element
        info = self._catalog.get(base_element)
        return (_BUILTIN_ARRAY_OF.get(base_element) or (info.array_oid if info else 0)
                or resolved)

    def is_array(self, oid: int) -> bool:
        """Whether ``oid``'s values are arrays (KV ``schemas``' ``is_array``): its base type
        (:meth:`base_type_oid`) is an array type, builtin or not (a domain over ``mood[]``,
        whose base type a consumer cannot tell from a scalar's without the catalog)."""
        return bool(self._element_of(self.base_type_oid(oid)))

    def _resolve_domain(self, oid: int, depth: int) -> int:
        info = self._catalog.get(oid)
        if info is None or info.kind != "d" or not info.base_oid or depth > 16:
            return oid
        return self._resolve_domain(info.base_oid, depth + 1)

    def _element_of(self, oid: int) -> int:
        """The element type of the array type ``oid`` (0: not an array type)."""
        element = _BUILTIN_ARRAYS.get(oid)
        if element is not None:
            return element
        info = self._catalog.get(oid)
        return info.element_oid if info and info.category == "A" and info.kind != "d" else 0

    def for_columns(self, columns: Sequence[Any]) -> list[Converter]:
        """One text->value function per column (objects with ``.type_oid``)."""
        return [self.converter(column.type_oid) for column in columns]

    def type_name(self, oid: int) -> str:
        if oid in _BUILTIN_NAMES:
            return _BUILTIN_NAMES[oid]
        if oid in _BUILTIN_ARRAYS:
            return self.type_name(_BUILTIN_ARRAYS[oid]) + "[]"
        info = self._catalog.get(oid)
        if info is None:
            return str(oid)
        if info.category == "A" and info.element_oid:
            return self.type_name(info.element_oid) + "[]"
        return info.name if info.namespace in ("pg_catalog", "public") else \
            f"{info.namespace}.{info.name}"


def convert_row(converters: Sequence[Converter], texts: Sequence[str | None]) -> list[Any]:
    """Convert one row of texts (None = NULL) with per-column converters."""
    return [None if text is None else convert(text)
            for convert, text in zip(converters, texts, strict=True)]
