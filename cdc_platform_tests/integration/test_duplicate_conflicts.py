"""The bridge's own defence against message ids taken by someone else (docs/wire-contract.md
"Message ids taken by other content"): real PostgreSQL, real nats-server, the bridge in both publish
modes."""

import logging

import msgpack
import pytest

from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform_tests.fixtures.bridge import running_bridge, slot_confirmed, wait_for
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major

MODES = ["fast-batch", "per-message"]


@pytest.fixture
def table(cdc_database, pg_admin):
    name = random_name("planted")
    pg_admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, item text)")
    cdc_database.add_tables(pg_admin, name)
    return name


def create_slot(pg_admin, slot: str) -> None:
    pg_admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


def next_commit_lsn(pg_admin, slot: str, publication: str) -> str:
    """The commit LSN of the first transaction the slot will send (its BEGIN message's
    final LSN): what the bridge's message ids of that transaction begin with."""
    rows = pg_admin.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)", (slot, publication)).fetchall()
    begin = next(bytes(data) for (data,) in rows if bytes(data)[:1] == b"B")
    return format_lsn(int.from_bytes(begin[1:9], "big"))


@pytest.mark.parametrize("mode", MODES)
async def test_a_planted_message_id_raises_the_alarm_and_the_change_is_stored(
        mode, table, cdc_database, pg_admin, provisioned_nats, nats_client, caplog):
    """A client that may publish into ``cdc.>`` stores other content under the ids of the
    next transaction's first two changes before the bridge sends them. The bridge finds its
    duplicates taken by other content: one error line each (id, subject, stream sequence),
    ``bridge_duplicate_conflicts_total`` 2 in /metrics and /status, and each change stored
    under ``{id}:conflict:{random}``; the slot is confirmed past the transaction only then."""
    caplog.set_level(logging.INFO)
    create_slot(pg_admin, cdc_database.slot)
    pg_admin.execute(f"INSERT INTO {table} (id, item) SELECT i, 'genuine ' || i "
                     "FROM generate_series(1, 3) AS i")
    commit_lsn = next_commit_lsn(pg_admin, cdc_database.slot, cdc_database.publication)
    js = nats_client.jetstream()
    planted = {}
    for ordinal in (0, 1):
        forged = msgpack.packb({"table": table, "operation": "DELETE", "data": {"id": 1},
                                "commit_lsn": commit_lsn, "ordinal": ordinal})
        ack = await js.publish(f"cdc.{table}.insert", forged, stream="CDC",
                               headers={"Nats-Msg-Id": f"{commit_lsn}:{ordinal}"})
        planted[f"{commit_lsn}:{ordinal}"] = ack.seq

    settings = platform_settings(cdc_database, provisioned_nats.url, publish_mode=mode)
    async with running_bridge(settings) as bridge:
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=5)
        # (stored again after the batch's or the pipeline's later messages: by ordinal here)
        genuine = sorted((message for message in messages
                          if msgpack.unpackb(message.data)["operation"] == "INSERT"),
                         key=lambda message: msgpack.unpackb(message.data)["ordinal"])
        events = [msgpack.unpackb(message.data) for message in genuine]
        assert [event["data"] for event in events] == [
            {"id": i, "item": f"genuine {i}"} for i in (1, 2, 3)]
        assert [message.headers["Nats-Msg-Id"].split(":conflict:")[0] for message in genuine] \
            == [event["msg_id"] for event in events] == [f"{commit_lsn}:{i}" for i in (0, 1, 2)]
        assert [":conflict:" in message.headers["Nats-Msg-Id"] for message in genuine] \
            == [True, True, False]
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.duplicate_conflicts) == 2,
                       what="the conflicts in the metrics")
        assert b"bridge_duplicate_conflicts_total 2.0" in bridge.metrics.exposition()
        assert bridge.metrics.status()["duplicate_conflicts"] == 2
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot)
                       > parse_lsn(commit_lsn), what="the transaction confirmed")
        assert bridge.publisher.mode == mode
    for msg_id, seq in planted.items():
        assert any(record.levelname == "ERROR" and f"Nats-Msg-Id {msg_id} on cdc.{table}.insert"
                   in record.getMessage() and f"stream seq {seq}" in record.getMessage()
                   for record in caplog.records), msg_id


@pytest.mark.parametrize("mode", MODES)
async def test_a_replay_of_stored_changes_is_no_conflict_and_stores_nothing_twice(
        mode, table, cdc_database, pg_admin, provisioned_nats, nats_client, caplog):
    """The same transaction published by two bridge runs, the second replaying it from a
    slot that never confirmed it (as after a crash): every duplicate is read back and found
    to be the same change, no alarm, nothing stored twice."""
    caplog.set_level(logging.INFO)
    behind = random_name("behind")
    create_slot(pg_admin, cdc_database.slot)
    create_slot(pg_admin, behind)
    try:
        pg_admin.execute(f"INSERT INTO {table} (id, item) SELECT i, 'row ' || i "
                         "FROM generate_series(1, 200) AS i")
        settings = platform_settings(cdc_database, provisioned_nats.url, publish_mode=mode)
        async with running_bridge(settings):
            first = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=200,
                                        schema_events=True)
        replay = settings.model_copy(update={"postgres": cdc_database.settings(slot=behind)})
        async with running_bridge(replay) as bridge:
            await wait_for(lambda: bridge.publisher is not None
                           and bridge.publisher.stats.duplicates_checked >= 200,
                           what="the replayed duplicates checked")
            assert bridge.publisher.stats.duplicate_conflicts == 0
            assert bridge.metrics.value(bridge.metrics.duplicate_conflicts) == 0
        again = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", schema_events=True)
    finally:
        pg_admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                         "WHERE slot_name = %s", (behind,))
    assert [message.headers["Nats-Msg-Id"] for message in again] \
        == [message.headers["Nats-Msg-Id"] for message in first]
    assert not any("conflict" in record.getMessage() for record in caplog.records)
