"""The platform's judgement of the mirrors' states (cdc_platform/fleet.py), which readers
wrote: what is not a state is refused with a reason, and the checks' verdicts."""

from __future__ import annotations

import json

import pytest

from cdc_platform.errors import ConfigError
from cdc_platform.fleet import (
    Fleet,
    NotAState,
    equality,
    freshness,
    parse_state,
    seen_since,
    stopped_since,
)
from cdc_platform.mirror.fleet import default_mirror_id
from cdc_platform.settings import MirrorSettings, load_settings


def _state(mirror_id: str = "edge", lag: float = 1.0, *, status: str = "streaming",
           stopped_at: str | None = None, **tables) -> bytes:
    value = {"mirror_id": mirror_id, "lag_seconds": lag, "lag_bytes": 10,
             "tables": {name: {"status": status, "last_verification": last}
                        for name, last in tables.items()}}
    if stopped_at is not None:
        value["stopped_at"] = stopped_at
    return json.dumps(value).encode()


def _verified(verification_id: str, status: str, differing: int = 0, repaired: int = 0):
    return {"verification_id": verification_id, "status": status,
            "buckets_differing": differing, "rows_repaired": repaired}


@pytest.mark.parametrize(("data", "why"), [
    (b"\xff", "not JSON"), (b"[1]", "not a JSON object"),
    (_state("other"), "is not its key"), (_state(lag=-1), "lag_seconds"),
    (b'{"mirror_id": "edge", "lag_seconds": NaN, "tables": {}}', "lag_seconds"),
    (b'{"mirror_id": "edge", "lag_seconds": true, "tables": {}}', "lag_seconds"),
    (b'{"mirror_id": "edge", "lag_seconds": 1, "tables": []}', "tables"),
    (b'{"mirror_id": "edge", "lag_seconds": 1, "tables": {"t": {"status": 1}}}', "status"),
])
def test_a_value_that_is_not_a_state_is_refused_with_why(data, why):
    with pytest.raises(NotAState, match=why):
        parse_state("edge", data)


def test_what_a_state_says_of_its_verifications_is_taken_only_when_well_typed():
    state = parse_state("edge", _state(users=_verified("v1", "differ", 3, 7),
                                       orders={"verification_id": 5, "status": None,
                                               "buckets_differing": -2, "rows_repaired": "x"},
                                       items=None))
    assert state.tables["users"].verification_status == "differ"
    assert (state.tables["users"].buckets_differing, state.tables["users"].rows_repaired) == (3, 7)
    orders = state.tables["orders"]
    assert (orders.verification_id, orders.buckets_differing, orders.rows_repaired) == (None, 0, 0)
    assert state.tables["items"].verification_id is None


def test_freshness_fails_for_lag_gone_and_unreadable_mirrors():
    fleet = Fleet(states={"a": parse_state("a", _state("a", 10)),
                          "b": parse_state("b", _state("b", 301))})
    judged = freshness(fleet, {"a": 0.0, "b": 0.0, "c": 0.0}, 300)
    assert not judged.passed and not judged.warning_only
    assert judged.metadata["lagging"] == {"b": 301.0} and judged.metadata["gone"] == ["c"]
    fleet.unreadable["d"] = "not JSON"
    assert "1 unreadable" in freshness(fleet, {}, 400).description
    del fleet.unreadable["d"]
    assert freshness(fleet, {"a": 0.0}, 400).passed


def test_a_table_waiting_for_a_schema_it_can_mirror_fails_freshness_with_why():
    """A waiting table follows nothing until the source changes: red, naming mirror, table
    and why, however small the mirror's lag (its other tables stream)."""
    value = json.loads(_state("a", 0.0, t=None, u=None))
    value["tables"]["t"].update(status="waiting", reason="t: columns 'z' and 'Z' differ")
    fleet = Fleet(states={"a": parse_state("a", json.dumps(value).encode()),
                          "b": parse_state("b", _state("b", 0.0, t=None))})
    assert fleet.states["a"].tables["t"].reason == "t: columns 'z' and 'Z' differ"
    assert fleet.states["a"].tables["u"].reason is None
    judged = freshness(fleet, {}, 300)
    assert not judged.passed and not judged.warning_only
    assert "1 with a table waiting for a schema it can mirror (a: t)" in judged.description
    assert judged.metadata["waiting"] == {"a": {"t": "t: columns 'z' and 'Z' differ"}}
    assert freshness(fleet, {}, 300, stopped={"a": "2026-11-26T00:00:00Z"}).passed


def test_a_gone_mirror_is_remembered_for_the_keep_time_only():
    fleet = Fleet(states={"a": parse_state("a", _state("a"))})
    seen = seen_since({"a": 10.0, "b": 50.0, "c": 5.0}, fleet, now=100.0, keep_seconds=60)
    assert seen == {"a": 100.0, "b": 50.0}


def test_equality_passes_when_every_follower_met_the_verification_equal_or_repaired():
    states = [parse_state("a", _state("a", users=_verified("v2", "equal"))),
              parse_state("b", _state("b", users=_verified("v2", "repaired", 2, 40))),
              parse_state("c", _state("c", orders=_verified("v2", "differ", 9)))]
    judged = equality("users", "v2", states)
    assert judged is not None and judged.passed
    assert judged.metadata["mirrors"] == {"a": "equal", "b": "repaired"}
    assert judged.metadata["rows_repaired"] == 40
    assert equality("nobody_follows", "v2", states) is None


def test_equality_fails_on_differ_and_not_comparable_and_warns_while_pending():
    states = [parse_state("a", _state("a", users=_verified("v2", "differ", 3))),
              parse_state("b", _state("b", users=_verified("v2", "not_comparable"))),
              parse_state("c", _state("c", users=_verified("v1", "equal"))),
              parse_state("d", _state("d", users=None))]
    judged = equality("users", "v2", states)
    assert judged is not None and not judged.passed and not judged.warning_only
    assert judged.metadata["buckets_differing"] == 3
    assert judged.metadata["not_comparable"] == ["b"]
    assert judged.metadata["pending"] == ["c", "d"]
    waiting = equality("users", "v2", states[2:])
    assert waiting is not None and not waiting.passed and waiting.warning_only


def test_a_mirror_id_is_a_name_or_a_teams_name_and_defaults_to_a_subject_token(monkeypatch):
    assert MirrorSettings(mirror_id="team_a.edge-1").mirror_id == "team_a.edge-1"
    for bad in ("a.b.c", "a b", "edge.*", "", "x" * 65, "team.>"):
        monkeypatch.setenv("CDC_MIRROR_ID", bad)
        with pytest.raises(ConfigError, match="CDC_MIRROR_ID"):
            load_settings(MirrorSettings)
    made = default_mirror_id("/data/my mirror.v2.db")
    assert made.endswith("-my_mirror_v2")
    MirrorSettings(mirror_id=made)  # (valid as it is)


def test_a_resyncing_table_is_not_equal_until_verified_again():
    """Whatever a resyncing mirror met before (equal, or nothing yet), it warns; a differ
    it met still fails."""
    states = [parse_state("a", _state("a", users=_verified("v2", "equal"))),
              parse_state("b", _state("b", status="resyncing", users=_verified("v2", "equal"))),
              parse_state("c", _state("c", status="resyncing", users=_verified("v1", "equal")))]
    judged = equality("users", "v2", states)
    assert judged is not None and not judged.passed and judged.warning_only
    assert judged.metadata["mirrors"] == {"a": "equal", "b": "resyncing", "c": "resyncing"}
    assert judged.metadata["resyncing"] == ["b", "c"] and judged.metadata["pending"] == []
    assert "2 of 3 mirror(s) resyncing" in judged.description
    differ = parse_state("d", _state("d", status="resyncing", users=_verified("v2", "differ", 4)))
    failed = equality("users", "v2", [*states, differ])
    assert failed is not None and not failed.warning_only
    assert failed.metadata["mirrors"]["d"] == "differ"


def test_a_mirror_that_stopped_on_purpose_is_stopped_not_gone_nor_lagging():
    stopped_at = "2026-11-26T09:00:00Z"
    fleet = Fleet(states={
        "a": parse_state("a", _state("a", 1.0)),
        "b": parse_state("b", _state("b", 900.0, stopped_at=stopped_at))})
    seen = seen_since({}, fleet, now=100.0, keep_seconds=60)
    stopped = stopped_since({}, fleet, seen)
    assert stopped == {"b": stopped_at}
    judged = freshness(fleet, seen, 300, stopped)
    assert judged.passed, judged.description
    assert judged.metadata["stopped"] == {"b": stopped_at}
    assert judged.metadata["lagging"] == {} and judged.metadata["max_lag_seconds"] == 1.0
    assert judged.description.endswith("; 1 stopped")
    # its state gone from KV after the TTL: still stopped while remembered, not gone
    later = Fleet(states={"a": fleet.states["a"]})
    seen = seen_since(seen, later, now=130.0, keep_seconds=60)
    stopped = stopped_since(stopped, later, seen)
    judged = freshness(later, seen, 300, stopped)
    assert judged.passed and judged.metadata["gone"] == [] and stopped == {"b": stopped_at}
    # forgotten with the gone ones (CDC_MIRROR_GONE_KEEP)
    seen = seen_since(seen, later, now=200.0, keep_seconds=60)
    assert stopped_since(stopped, later, seen) == {}
    # one that crashed (no stopped_at) is gone; one started again is running
    assert freshness(later, {"a": 1.0, "c": 1.0}, 300, {}).metadata["gone"] == ["c"]
    again = Fleet(states={"b": parse_state("b", _state("b", 1.0))})
    assert stopped_since({"b": stopped_at}, again, {"b": 1.0}) == {}
