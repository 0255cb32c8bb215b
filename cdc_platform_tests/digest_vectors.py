"""Golden vectors of the table digest (docs/verification.md): typed rows holding the edge values
of every type of the type mapping, with their row bytes, row and key hashes, buckets and bucket
digests, in ``data/golden/digest_vectors.json``. ``test_digest.py`` checks the algorithm still
gives exactly these, and that every value comes back from the mirror's SQLite form unchanged;
``integration/test_digest_source.py`` that PostgreSQL's rows of the SQL expressions given for
the edge rows (``sql``) reach the same hashes through the snapshot reader's converters.

In the file, a value is JSON except where JSON cannot say it: a float is ``{"float": repr}``
(``"nan"``, ``"inf"``, ``"-inf"``, ``"-0.0"``, ``"0.1"``), bytes are ``{"bytes": hex}``.

Write the file again only on purpose (a change of the digest, in the CHANGELOG):

    .venv/bin/python -m cdc_platform_tests.digest_vectors
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cdc_platform.wire.digest import RowDigester, TableDigest

PATH = Path(__file__).resolve().parent / "data" / "golden" / "digest_vectors.json"

NAN, INF = math.nan, math.inf

# name, type oid, data_type, then one value per row of the table (None: NULL)
Columns = list[tuple[str, int, str, list[Any]]]
BIG_JSON = '{"n": 123456789012345678901234567890}'
EDGE_COLUMNS: Columns = [
    ("id", 23, "integer", [1, 2, 3, 4]),
    ("i8", 20, "bigint", [-9223372036854775808, 9223372036854775807, None, 0]),
    ("x8", 5069, "xid8", [18446744073709551615, 0, None, 9223372036854775808]),
    ("flag", 16, "boolean", [True, False, None, True]),
    ("f8", 701, "double precision", [NAN, INF, None, -0.0]),
    ("f8b", 701, "double precision", [-INF, 5e-324, None, 0.0]),
    ("f4", 700, "real", [0.1, 3.4028235e38, None, 1.0]),
    ("num", 1700, "numeric", ["12.50", "NaN", None, "-0.000001"]),
    ("num_inf", 1700, "numeric", ["Infinity", "123456789012345678901234567890.123", None, "0"]),
    ("txt", 25, "text", ["", "héllo wörld ✓", None, "𝄞 NaN"]),
    ("txt_like", 25, "text", ["NaN", "\\xab", None, "null"]),
    ("pad", 1042, "character(5)", ["ab   ", "x    ", None, "     "]),
    ("doc", 3802, "jsonb", ["null", BIG_JSON, None, '{"a": [1, 2.50]}']),
    ("raw_json", 114, "json", ['{"a": 1, "a": 2}', "[]", None, "  1 "]),
    ("day", 1082, "date", ["0000-12-31", "-4712-01-01", None, "5874897-12-31"]),
    ("day_inf", 1082, "date", ["infinity", "-infinity", None, "2025-12-08"]),
    ("ts", 1114, "timestamp without time zone",
     ["0000-12-31T23:59:59.5", "294276-12-31T23:59:59.999999", None, "2025-01-02T03:04:05.1"]),
    ("tstz", 1184, "timestamp with time zone",
     ["infinity", "2025-12-08T13:45:21.719719Z", None, "0000-01-01T00:00:00Z"]),
    ("tm", 1083, "time without time zone", ["24:00:00", "13:45:21.5", None, "00:00:00"]),
    ("tmtz", 1266, "time with time zone",
     ["24:00:00+15:59", "00:00:00-15:59", None, "13:45:21.5+02:00"]),
    ("span", 1186, "interval", ["P-178000000Y", "P1Y2M3DT4H5M6.5S", None, "PT0S"]),
    ("uid", 2950, "uuid", ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
                           "00000000-0000-0000-0000-000000000000", None,
                           "ffffffff-ffff-ffff-ffff-ffffffffffff"]),
    ("addr", 869, "inet", ["192.168.0.1/24", "::1", None, "10.0.0.1"]),
    ("blob", 17, "bytea", [b"", b"\xde\xad\xbe\xef", None, b"\x00"]),
    ("ints", 1007, "integer[]", [[1, None, 3], [[1, 2], [3, 4]], None, []]),
    ("floats", 1022, "double precision[]", [[NAN, INF, -INF, -0.0, 1.5, None], [0.1], None, []]),
    ("blobs", 1001, "bytea[]", [[b"\x00\xff", None, b""], [b"\\x"], None, []]),
    ("texts", 1009, "text[]", [["a", "b c", None, "NaN"], ["\\x00", "null", ""], None, [None]]),
    ("docs", 3807, "jsonb[]", [[BIG_JSON, None], ["null"], None, []]),
    ("flags", 1000, "boolean[]", [[True, False, None], [], None, [False]]),
    ("xids", 271, "xid8[]", [[18446744073709551615], [0], None, []]),
    ("mood", 16400, "mood", ["happy", "sad", None, "ok"]),
]
# The same rows in PostgreSQL (cdc_platform_tests/integration/test_digest_source.py): per
# column, the value of each row as an SQL expression whose wire value is the one above.
EDGE_SQL: dict[str, list[str]] = {
    "id": ["1", "2", "3", "4"],
    "i8": ["'-9223372036854775808'", "9223372036854775807", "NULL", "0"],
    "x8": ["'18446744073709551615'", "'0'", "NULL", "'9223372036854775808'"],
    "flag": ["true", "false", "NULL", "true"],
    "f8": ["'NaN'", "'Infinity'", "NULL", "'-0'"],
    "f8b": ["'-Infinity'", "'5e-324'", "NULL", "'0'"],
    "f4": ["'0.1'", "'3.4028235e38'", "NULL", "'1'"],
    "num": ["'12.50'", "'NaN'", "NULL", "'-0.000001'"],
    "num_inf": ["'Infinity'", "'123456789012345678901234567890.123'", "NULL", "'0'"],
    "txt": ["''", "'héllo wörld ✓'", "NULL", "'𝄞 NaN'"],
    "txt_like": ["'NaN'", "'\\xab'", "NULL", "'null'"],
    "pad": ["'ab'", "'x'", "NULL", "''"],
    "doc": ["'null'", f"'{BIG_JSON}'", "NULL", "'{\"a\": [1, 2.50]}'"],
    "raw_json": ["'{\"a\": 1, \"a\": 2}'", "'[]'", "NULL", "'  1 '"],
    "day": ["'0001-12-31 BC'", "'4713-01-01 BC'", "NULL", "'5874897-12-31'"],
    "day_inf": ["'infinity'", "'-infinity'", "NULL", "'2025-12-08'"],
    "ts": ["'0001-12-31 23:59:59.5 BC'", "'294276-12-31 23:59:59.999999'", "NULL",
           "'2025-01-02 03:04:05.100'"],
    "tstz": ["'infinity'", "'2025-12-08 13:45:21.719719+00'", "NULL",
             "'0001-01-01 00:00:00+00 BC'"],
    "tm": ["'24:00:00'", "'13:45:21.5'", "NULL", "'00:00:00'"],
    "tmtz": ["'24:00:00+15:59'", "'00:00:00-15:59'", "NULL", "'13:45:21.5+02'"],
    "span": ["'-178000000 years'", "'1 year 2 months 3 days 4:05:06.5'", "NULL", "'0'"],
    "uid": ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'",
            "NULL", "'FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF'"],
    "addr": ["'192.168.0.1/24'", "'::1'", "NULL", "'10.0.0.1'"],
    "blob": ["'\\x'", "'\\xdeadbeef'", "NULL", "'\\x00'"],
    "ints": ["'{1,NULL,3}'", "'{{1,2},{3,4}}'", "NULL", "'{}'"],
    "floats": ["'{NaN,Infinity,-Infinity,-0,1.5,NULL}'", "'{0.1}'", "NULL", "'{}'"],
    "blobs": ["ARRAY['\\x00ff'::bytea, NULL, '\\x'::bytea]", "ARRAY['\\x5c78'::bytea]", "NULL",
              "'{}'"],
    "texts": ["ARRAY['a', 'b c', NULL, 'NaN']", "ARRAY['\\x00', 'null', '']", "NULL",
              "ARRAY[NULL]::text[]"],
    "docs": [f"ARRAY['{BIG_JSON}'::jsonb, NULL]", "ARRAY['null'::jsonb]", "NULL", "'{}'"],
    "flags": ["'{t,f,NULL}'", "'{}'", "NULL", "'{f}'"],
    "xids": ["ARRAY['18446744073709551615'::xid8]", "ARRAY['0'::xid8]", "NULL", "'{}'"],
    "mood": ["'happy'", "'sad'", "NULL", "'ok'"],
}
EDGE_KEY = ["id"]
EDGE_BITS = 2

# A table without a primary key (REPLICA IDENTITY FULL): two equal rows count twice; NULL,
# the empty string and JSON null are three different rows.
LEDGER_COLUMNS: Columns = [
    ("tx", 23, "integer", [1, 1, 2, 3, 4]),
    ("note", 25, "text", ["x", "x", None, "", "null"]),
    ("doc", 3802, "jsonb", [None, None, None, None, "null"]),
]

# Names that sort differently by UTF-16 (JavaScript) and by UTF-8 bytes (the rule), quoting
# and a composite key.
NAMES_COLUMNS: Columns = [
    ("Order Lines", 25, "text", ["a", "b"]),
    ("z", 20, "bigint", [1, 1]),
    ("Zed", 25, "text", ["k", "k"]),
    ("ä", 25, "text", ["u", "v"]),
    ("\uff5e", 25, "text", ["bmp", "bmp"]),
    ("\U0001d11e", 25, "text", ["astral", "astral"]),
]
NAMES_KEY = ["z", "Order Lines"]

# The worked example of docs/verification.md.
EXAMPLE_COLUMNS: Columns = [
    ("id", 23, "integer", [1]),
    ("name", 25, "text", ["ada"]),
    ("score", 701, "double precision", [None]),
]
EXAMPLE_KEY = ["id"]

TABLES: dict[str, tuple[Columns, list[str], int, dict[str, list[str]] | None]] = {
    "example": (EXAMPLE_COLUMNS, EXAMPLE_KEY, 2, None),
    "edges": (EDGE_COLUMNS, EDGE_KEY, EDGE_BITS, EDGE_SQL),
    "ledger": (LEDGER_COLUMNS, [], 1, None),
    "names": (NAMES_COLUMNS, NAMES_KEY, 1, None),
}


def to_json(value: Any) -> Any:
    """A wire value as this file writes it."""
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def rows_of(columns: Columns) -> list[dict[str, Any]]:
    count = len(columns[0][3])
    return [{name: values[index] for name, _, _, values in columns} for index in range(count)]


def table_vectors(columns: Columns, key: list[str], bits: int,
                  sql: dict[str, list[str]] | None) -> dict[str, Any]:
    digester = RowDigester([name for name, *_ in columns], key)
    digest = TableDigest(bits)
    rows = []
    for index, row in enumerate(rows_of(columns)):
        row_hash, key_hash = digester.row_hash(row), digester.key_hash(row)
        digest.add(key_hash, row_hash)
        rows.append({"values": {name: to_json(value) for name, value in row.items()},
                     **({"sql": {name: sql[name][index] for name in row}} if sql else {}),
                     "row_bytes": digester.row_bytes(row).hex(),
                     "row_hash": f"{row_hash:016x}", "key_hash": f"{key_hash:016x}",
                     "bucket": key_hash >> (64 - bits)})
    return {
        "columns": [{"name": name, "type_oid": oid, "data_type": data_type,
                     "is_primary_key": name in key}
                    for name, oid, data_type, _ in columns],
        "primary_key": key,
        "bits": bits,
        "rows": rows,
        "buckets": [{"bucket": index, "total": f"{digest.totals[index]:016x}",
                     "count": digest.counts[index]} for index in range(1 << bits)],
    }


def build() -> dict[str, Any]:
    return {"tables": {name: table_vectors(*spec) for name, spec in TABLES.items()}}


def main() -> None:
    PATH.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
