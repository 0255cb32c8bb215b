"""Values of every msgpack type the wire contract writes, and an exact comparison of decoded
values (NaN equals NaN, -0.0 is not 0.0, int is not bool): shared by the decoder tests."""

from __future__ import annotations

import math

from hypothesis import strategies as st

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from(["x" * 31, "x" * 32, "é" * 200, "y" * 70000, b"z" * 300, 2**32, -(2**31) - 1,
                     -33, -32, 127, 128, 255, 256, 65535, 65536]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)

def same(got, want) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(
            same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want and (
        not isinstance(want, float) or math.copysign(1, got) == math.copysign(1, want))
