"""Value conversion on PostgreSQL's text output (as printed with REQUIRED_SESSION_SETTINGS).

The texts here are what a PostgreSQL 15/18 server prints; test_values_server.py checks the
same expectations against a live server, through both the ::text and the COPY paths.
"""

import math
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_platform.errors import ConversionError
from cdc_platform.protocol.copy_text import iter_rows, parse_line, unescape
from cdc_platform.protocol.values import TypeRegistry, convert_row, parse_array

R = TypeRegistry()

GOLDEN = [
    (21, "-32768", -32768), (23, "2147483647", 2147483647),
    (20, "-9223372036854775808", -9223372036854775808), (26, "4294967295", 4294967295),
    (701, "1.5", 1.5), (700, "0.1", 0.1), (701, "Infinity", math.inf),
    (701, "-Infinity", -math.inf),
    (1700, "123.4500", "123.4500"), (1700, "NaN", "NaN"), (1700, "-Infinity", "-Infinity"),
    (1700, "12345678901234567890.000000000000000001", "12345678901234567890.000000000000000001"),
    (16, "t", True), (16, "f", False),
    (25, "", ""), (1043, "héllo", "héllo"), (1042, "ab  ", "ab  "), (19, "name", "name"),
    (2950, "f4b0611f-7258-47f8-bceb-0eba9ac5195a", "f4b0611f-7258-47f8-bceb-0eba9ac5195a"),
    # json/jsonb: the exact text (numbers of any size, json's own spacing and duplicates)
    (114, '{"a": [1, 2.5, null], "a": {"c": "d"}}', '{"a": [1, 2.5, null], "a": {"c": "d"}}'),
    (3802, '{"big": 123456789012345678901234567890}', '{"big": 123456789012345678901234567890}'),
    (3802, '{"n": 18446744073709551617, "x": 0.1000000000000000000001}',
     '{"n": 18446744073709551617, "x": 0.1000000000000000000001}'),
    (3802, '"just a string"', '"just a string"'), (3802, "null", "null"),
    (1082, "2025-12-08", "2025-12-08"), (1082, "4714-11-24 BC", "-4713-11-24"),
    (1082, "0001-12-31 BC", "0000-12-31"), (1082, "0002-01-01 BC", "-0001-01-01"),
    (1082, "5874897-12-31", "5874897-12-31"),
    (1114, "0001-12-31 23:59:59.5 BC", "0000-12-31T23:59:59.5"),
    (1114, "294276-12-31 23:59:59.999999", "294276-12-31T23:59:59.999999"),
    (1184, "0001-01-01 00:00:00+00 BC", "0000-01-01T00:00:00Z"),
    (1083, "24:00:00", "24:00:00"), (1266, "24:00:00+15:59", "24:00:00+15:59"),
    (1082, "infinity", "infinity"),
    (1114, "2025-12-08 13:45:21.719719", "2025-12-08T13:45:21.719719"),
    (1114, "-infinity", "-infinity"),
    (1184, "2025-12-08 13:45:21.719719+00", "2025-12-08T13:45:21.719719Z"),
    (1184, "0044-03-15 12:00:00+00 BC", "-0043-03-15T12:00:00Z"),
    (1184, "infinity", "infinity"),
    (1083, "13:45:21.5", "13:45:21.5"), (1266, "13:45:21+02", "13:45:21+02:00"),
    (1266, "13:45:21-05:30", "13:45:21-05:30"),
    (1186, "P1Y2M3DT4H5M6.5S", "P1Y2M3DT4H5M6.5S"), (1186, "PT0S", "PT0S"),
    (17, "\\xdeadbeef", b"\xde\xad\xbe\xef"), (17, "\\x", b""),
    (869, "192.168.0.1/24", "192.168.0.1/24"), (650, "10.0.0.0/8", "10.0.0.0/8"),
    (829, "08:00:2b:01:02:03", "08:00:2b:01:02:03"), (790, "$1,000.00", "$1,000.00"),
    (1560, "101", "101"), (600, "(1,2)", "(1,2)"), (3904, "[1,5)", "[1,5)"),
    (1007, "{1,NULL,3}", [1, None, 3]), (1007, "{}", []),
    (1009, '{"a,b","c\\"d",NULL,"NULL","","x\\\\y"}', ["a,b", 'c"d', None, "NULL", "", "x\\y"]),
    (1009, '{{a,b},{c,NULL}}', [["a", "b"], ["c", None]]),
    (1007, "[0:1]={1,2}", [1, 2]),
    (1007, "{{{1,2}},{{3,4}}}", [[[1, 2]], [[3, 4]]]),
    (1231, "{1.50,NaN}", ["1.50", "NaN"]),
    (1022, "{NaN,Infinity,-1.5}", [math.nan, math.inf, -1.5]),
    (3807, '{"{\\"a\\": 1}",NULL}', ['{"a": 1}', None]),
    (1185, '{"2025-01-01 00:00:00+00",NULL}', ["2025-01-01T00:00:00Z", None]),
    (2951, "{f4b0611f-7258-47f8-bceb-0eba9ac5195a}", ["f4b0611f-7258-47f8-bceb-0eba9ac5195a"]),
    (1000, "{t,f,NULL}", [True, False, None]),
    (1001, '{"\\\\x01",NULL}', [b"\x01", None]),
    (1020, "{(1,1),(0,0);(2,2),(1,1)}", ["(1,1),(0,0)", "(2,2),(1,1)"]),
    (987654, "anything an extension prints", "anything an extension prints"),
]


def _same(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


@pytest.mark.parametrize(("oid", "text", "expected"), GOLDEN)
def test_golden(oid, text, expected):
    assert _same(R.converter(oid)(text), expected)


def test_nan_float():
    assert math.isnan(R.converter(701)("NaN"))


def test_domains_enums_and_custom_arrays_from_catalog_rows():
    registry = TypeRegistry()
    # oid, typname, nspname, typtype, typcategory, typelem, typbasetype, typdelim
    assert registry.missing_oids([16500, 16501, 16502, 16503]) == {16500, 16501, 16502, 16503}
    registry.add_catalog_rows([
        (16500, "mood", "public", "e", "E", 0, 0, ","),
        (16501, "_mood", "public", "b", "A", 16500, 0, ","),
        (16502, "positive_int", "public", "d", "N", 0, 23, ","),
        (16503, "_positive_int", "public", "b", "A", 16502, 0, ","),
    ])
    assert registry.missing_oids([16500, 16501, 16502, 16503]) == set()
    assert registry.converter(16500)("happy") == "happy"
    assert registry.converter(16501)("{sad,NULL,happy}") == ["sad", None, "happy"]
    assert registry.converter(16502)("42") == 42
    assert registry.converter(16503)("{1,2}") == [1, 2]
    assert registry.type_name(16503) == "positive_int[]"
    assert registry.type_name(1007) == "integer[]"


def test_domain_over_unknown_base_is_reported_missing():
    registry = TypeRegistry()
    registry.add_catalog_rows([(16600, "d", "public", "d", "S", 0, 16601, ",")])
    assert registry.missing_oids([16600]) == {16601}


@pytest.mark.parametrize("bad", ["", "1,2", "{1,2", "{1,2}x", '{"a}', "[0:1]"])
def test_malformed_arrays_raise_clear_error(bad):
    with pytest.raises(ConversionError):
        parse_array(bad)


def test_convert_row_keeps_nulls():
    converters = R.for_columns([type("C", (), {"type_oid": oid})() for oid in (23, 25, 16)])
    assert convert_row(converters, ["1", None, "t"]) == [1, None, True]


# -- a reference renderer of PostgreSQL array literals (array_out's quoting rules) -------------
def render(value) -> str:
    if isinstance(value, list):
        return "{" + ",".join(render(v) for v in value) + "}"
    if value is None:
        return "NULL"
    needs_quotes = (value == "" or value.upper() == "NULL"
                    or any(c in value for c in '{},"\\ \t\n\r\v\f'))
    if not needs_quotes:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


elements = st.one_of(st.none(), st.text(min_size=0, max_size=8))
arrays = st.recursive(st.lists(elements, max_size=5),
                      lambda children: st.lists(children, min_size=1, max_size=3), max_leaves=20)


@given(arrays)
def test_array_literals_round_trip(value):
    assert parse_array(render(value)) == value


@given(st.decimals(allow_nan=False, allow_infinity=False, places=None))
def test_numeric_text_stays_exact(number):
    text = str(number)
    assert Decimal(R.converter(1700)(text)) == number


def escape_copy(value: str) -> str:
    return (value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r"))


@given(st.lists(st.one_of(st.none(), st.text()), min_size=1, max_size=6))
def test_copy_text_round_trip(fields):
    line = "\t".join("\\N" if f is None else escape_copy(f) for f in fields)
    assert parse_line(line) == fields


def test_copy_escapes():
    assert unescape("a\\bb\\fc\\nd\\re\\tf\\vg\\\\h") == "a\bb\fc\nd\re\tf\vg\\h"
    assert unescape("\\101\\x42\\7") == "AB\x07"
    assert list(iter_rows("1\tx\n2\t\\N\n")) == [["1", "x"], ["2", None]]
    with pytest.raises(ConversionError):
        list(iter_rows("1\tx"))
