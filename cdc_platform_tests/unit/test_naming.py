import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_platform.naming import parse_wire_name, wire_name

SUBJECT_TOKEN = re.compile(r"[^\s.*>]+")
KV_KEY = re.compile(r"[-/_=.A-Za-z0-9]+")


@pytest.mark.parametrize(("schema", "table", "wire"), [
    ("public", "users", "users"),
    ("sales", "orders", "sales/orders"),
    ("public", "Order Lines", "Order=20Lines"),
    ("public", "a.b", "a=2Eb"),
    ("s/x", "t", "s=2Fx/t"),
])
def test_examples(schema, table, wire):
    assert wire_name(schema, table) == wire
    assert parse_wire_name(wire) == (schema, table)


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_round_trip_and_valid_as_subject_token_and_kv_key(schema, table):
    wire = wire_name(schema, table)
    assert parse_wire_name(wire) == (schema, table)
    assert SUBJECT_TOKEN.fullmatch(wire)
    assert KV_KEY.fullmatch(wire)


@pytest.mark.parametrize("bad", ["", "a/b/c", "a=zz", "a b", "x.y"])
def test_rejects_what_it_could_not_have_made(bad):
    with pytest.raises(ValueError):
        parse_wire_name(bad)
