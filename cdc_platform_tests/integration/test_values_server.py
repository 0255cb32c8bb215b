"""Value conversion against a live server: the same value via ::text and via COPY text."""

from decimal import Decimal

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_platform.protocol.copy_text import iter_rows
from cdc_platform.protocol.values import REQUIRED_SESSION_SETTINGS, TYPE_CATALOG_QUERY, TypeRegistry
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform_tests.fixtures.values import TEXT_CONVERSIONS, arrays, same_converted

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


@pytest.fixture(scope="module")
def conn(postgres_server):
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True,
                         options=SESSION_OPTIONS) as connection:
        connection.execute("DROP TYPE IF EXISTS vs_mood CASCADE")
        connection.execute("CREATE TYPE vs_mood AS ENUM ('sad', 'happy')")
        connection.execute("DROP DOMAIN IF EXISTS vs_positive CASCADE")
        connection.execute("CREATE DOMAIN vs_positive AS int CHECK (VALUE > 0)")
        yield connection


def test_session_settings_match_what_converters_expect(conn):
    for name, value in REQUIRED_SESSION_SETTINGS.items():
        shown = conn.execute(f"SHOW {name}").fetchone()[0]
        assert shown.replace(" ", "").lower() == value.replace(" ", "").lower(), name


SQL_EXPRESSIONS = [
    ("'NaN'::float8", 701), ("'-Infinity'::float4", 700), ("'NaN'::numeric", 1700),
    ("12.340::numeric(10,3)", 1700), ("1e-7::float8", 701), ("0.1::float4", 700),
    ("'4714-11-24 BC'::date", 1082), ("'2025-12-08 13:45:21.719719+02'::timestamptz", 1184),
    ("'0044-03-15 12:00 BC'::timestamp", 1114), ("'infinity'::timestamptz", 1184),
    ("'13:45:21+02'::timetz", 1266), ("'1 year 2 months 3 days 4:05:06.5'::interval", 1186),
    ("'\\xdeadbeef'::bytea", 17), ("''::bytea", 17), ("ARRAY['a,b', 'c\"d', NULL, 'NULL', '']",
                                                       1009),
    ("'[0:1]={1,2}'::int[]", 1007), ("ARRAY[[1,2],[3,NULL]]", 1007),
    ("ARRAY['{\"a\": 1}'::jsonb, NULL]", 3807), ("ARRAY['\\x01'::bytea]", 1001),
    ("'{\"big\": 123456789012345678901234567890}'::jsonb", 3802),
    ("ARRAY['(1,1),(0,0)'::box, '(2,2),(1,1)'::box]", 1020),
    ("'192.168.0.1/24'::inet", 869), ("'happy'::vs_mood", None),
    ("ARRAY['sad', NULL]::vs_mood[]", None), ("5::vs_positive", None),
    ("ARRAY[1, 2]::vs_positive[]", None),
]


def output_text(conn, expression) -> str | None:
    """What the type's output function prints (as pgoutput and COPY use it; ``::text`` is a
    cast and differs for some types, e.g. bool)."""
    result = conn.pgconn.exec_(f"SELECT {expression}".encode())
    value = result.get_value(0, 0)
    return None if value is None else value.decode()


def _convert_via_server(conn, expression, registry):
    oid = conn.execute(f"SELECT pg_typeof({expression})::oid::int").fetchone()[0]
    text = output_text(conn, expression)
    missing = registry.missing_oids([oid])
    while missing:
        registry.add_catalog_rows(conn.execute(TYPE_CATALOG_QUERY, (list(missing),)).fetchall())
        again = registry.missing_oids([oid])
        if again == missing:
            break
        missing = again
    with conn.cursor().copy(f"COPY (SELECT {expression}) TO STDOUT") as copy:
        copied = b"".join(bytes(block) for block in copy)
    (copy_text,), = list(iter_rows(copied.decode()))
    convert = registry.converter(oid)
    return convert(text), None if copy_text is None else convert(copy_text), oid


@pytest.mark.parametrize(("expression", "oid"), SQL_EXPRESSIONS)
def test_text_and_copy_paths_agree(conn, expression, oid):
    registry = TypeRegistry()
    via_text, via_copy, actual_oid = _convert_via_server(conn, expression, registry)
    if oid is not None:
        assert actual_oid == oid
    assert same_converted(via_text, via_copy)


def test_custom_types_are_typed(conn):
    registry = TypeRegistry()
    assert _convert_via_server(conn, "ARRAY['sad', NULL]::vs_mood[]", registry)[0] == [
        "sad", None]
    assert _convert_via_server(conn, "5::vs_positive", registry)[0] == 5
    assert _convert_via_server(conn, "ARRAY[1, 2]::vs_positive[]", registry)[0] == [1, 2]


@pytest.mark.parametrize(("oid", "text", "expected"),
                         [g for g in TEXT_CONVERSIONS if g[0] not in (987654, 790)])
def test_golden_texts_are_what_the_server_prints(conn, oid, text, expected):
    type_name = {1042: "bpchar", 1560: "bit(3)"}.get(oid) or conn.execute(
        "SELECT format_type(%s, NULL)", (oid,)).fetchone()[0]
    literal = conn.execute("SELECT quote_literal(%s)", (text,)).fetchone()[0]
    printed = output_text(conn, f"{literal}::{type_name}")
    registry = TypeRegistry()
    assert same_converted(registry.converter(oid)(printed), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays.filter(lambda a: _rectangular(a)))
def test_server_rendered_arrays_parse_back(conn, value):
    values = value if value else []
    cleaned = _no_nul(values)
    printed = conn.execute("SELECT %s::text[]::text", (cleaned,)).fetchone()[0]  # array_out
    assert TypeRegistry().converter(1009)(printed) == _flatten_empty(cleaned)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.decimals(allow_nan=False, allow_infinity=False, places=None, min_value=-10**30,
                   max_value=10**30))
def test_numeric_round_trips_through_server(conn, number):
    printed = conn.execute("SELECT %s::numeric::text", (number,)).fetchone()[0]
    assert Decimal(TypeRegistry().converter(1700)(printed)) == number


def _rectangular(value) -> bool:
    """PostgreSQL arrays are rectangular, of one depth: every sub-array of a level has the
    same shape (not only the same length)."""
    return _shape(value) is not None


def _shape(value) -> tuple | None:
    """(length, length of each element, ...) of a rectangular nesting; None otherwise."""
    if not isinstance(value, list):
        return ()
    if not value:
        return (0,)
    shapes = {_shape(v) for v in value}
    if len(shapes) != 1 or None in shapes:
        return None
    (inner,) = shapes
    if inner and inner[0] == 0:
        return None  # {{}} is not an array PostgreSQL prints
    return (len(value), *inner)


def _no_nul(value):
    if isinstance(value, list):
        return [_no_nul(v) for v in value]
    return value.replace("\x00", "") if isinstance(value, str) else value


def _flatten_empty(value):
    """PostgreSQL prints an array with empty inner arrays as {}."""
    def empty(v):
        return isinstance(v, list) and all(empty(x) for x in v)
    return [] if empty(value) else value
