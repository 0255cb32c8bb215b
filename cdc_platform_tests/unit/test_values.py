"""Value conversion on PostgreSQL's text output (as printed with REQUIRED_SESSION_SETTINGS).

The texts (``fixtures/values.py``) are what a PostgreSQL 15/18 server prints;
test_values_server.py checks the same expectations against a live server, through both the
::text and the COPY paths.
"""

import math
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_platform.errors import ConversionError
from cdc_platform.protocol.copy_text import iter_rows, parse_line, unescape
from cdc_platform.protocol.values import TypeRegistry, convert_row, parse_array
from cdc_platform_tests.fixtures.values import TEXT_CONVERSIONS, arrays, same_converted

R = TypeRegistry()


@pytest.mark.parametrize(("oid", "text", "expected"), TEXT_CONVERSIONS)
def test_golden(oid, text, expected):
    assert same_converted(R.converter(oid)(text), expected)


def test_nan_float():
    assert math.isnan(R.converter(701)("NaN"))


def test_domains_enums_and_custom_arrays_from_catalog_rows():
    registry = TypeRegistry()
    # oid, typname, nspname, typtype, typcategory, typelem, typbasetype, typdelim, typarray
    assert registry.missing_oids([16500, 16501, 16502, 16503]) == {16500, 16501, 16502, 16503}
    registry.add_catalog_rows([
        (16500, "mood", "public", "e", "E", 0, 0, ",", 16501),
        (16501, "_mood", "public", "b", "A", 16500, 0, ",", 0),
        (16502, "positive_int", "public", "d", "N", 0, 23, ",", 16503),
        (16503, "_positive_int", "public", "b", "A", 16502, 0, ",", 0),
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
    registry.add_catalog_rows([(16600, "d", "public", "d", "S", 0, 16601, ",", 0)])
    assert registry.missing_oids([16600]) == {16601}


def test_a_types_base_type_resolves_domains_and_the_elements_of_arrays():
    registry = TypeRegistry()
    registry.add_catalog_rows([
        (16700, "mood", "public", "e", "E", 0, 0, ",", 16701),
        (16701, "_mood", "public", "b", "A", 16700, 0, ",", 0),
        (16702, "score", "public", "d", "N", 0, 701, ",", 16703),  # over float8
        (16703, "_score", "public", "b", "A", 16702, 0, ",", 0),
        (16704, "score2", "public", "d", "N", 0, 16702, ",", 16705),  # over a domain
        (16705, "_score2", "public", "b", "A", 16704, 0, ",", 0),
        (16706, "ints", "public", "d", "A", 0, 1007, ",", 16707),  # over int4[]
        (16707, "_ints", "public", "b", "A", 16706, 0, ",", 0),
        (16708, "feeling", "public", "d", "E", 0, 16700, ",", 16709),  # over an enum
        (16709, "_feeling", "public", "b", "A", 16708, 0, ",", 0),
        (16710, "scores", "public", "d", "A", 0, 16703, ",", 0),  # over an array of a domain
        (16711, "moods", "public", "d", "A", 0, 16701, ",", 0),  # over an enum's array
        (16712, "feelings", "public", "d", "A", 0, 16709, ",", 0),  # over _feeling
    ])
    assert {oid: registry.base_type_oid(oid) for oid in range(16700, 16713)} == {
        16700: 16700, 16701: 16701,  # no domain: itself
        16702: 701, 16703: 1022, 16704: 701, 16705: 1022,
        16706: 1007, 16707: 1007,  # an array of an array domain: the array type
        16708: 16700, 16709: 16701,  # an enum's array from the catalog
        16710: 1022, 16711: 16701, 16712: 16701}
    # whether the values are arrays: the base type is an array type, builtin or not
    assert {oid for oid in range(16700, 16713) if registry.is_array(oid)} == {
        16701, 16703, 16705, 16706, 16707, 16709, 16710, 16711, 16712}
    assert [registry.is_array(oid) for oid in (23, 1007, 17, 99999)] == [False, True, False,
                                                                         False]
    assert registry.converter(16712)('{ok,NULL}') == ["ok", None]
    # builtins, and what the registry does not know, are themselves
    assert [registry.base_type_oid(oid) for oid in (23, 1007, 17, 99999)] == [23, 1007, 17, 99999]
    # the converter resolves as the base type says: a NaN of the domain over float8
    assert math.isnan(registry.converter(16704)("NaN"))
    assert registry.converter(16707)('{"{1,2}","{3}"}') == [[1, 2], [3]]


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
