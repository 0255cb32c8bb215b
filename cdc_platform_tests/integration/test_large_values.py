"""Rows larger than the NATS server's max_payload flow as claim checks (Object Store), in both
message modes, and the stream goes on; a consumer resolves the exact value."""

from __future__ import annotations

import pytest

from cdc_platform.consumer.claim_checks import resolve_payload
from cdc_platform.lsn import parse_lsn
from cdc_platform.publishing.claim_check import HEADER_CLAIM_CHECK
from cdc_platform.wire import decode_payload
from cdc_platform_tests.fixtures.bridge import running_bridge, slot_confirmed, wait_for
from cdc_platform_tests.fixtures.services import (
    SMALL_MAX_PAYLOAD,
    platform_settings,
    random_name,
    read_subjects,
)


@pytest.mark.parametrize("mode", ["per-change", "batched"])
async def test_a_row_over_max_payload_flows_as_a_claim_check(mode, small_nats, cdc_database,
                                                             pg_admin):
    server, client = small_nats
    table = random_name("large")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text, n int)")
    cdc_database.add_tables(pg_admin, table)
    big = "".join(f"{i:08d}" for i in range(40_000))  # 320 KB, not compressible by TOAST much
    settings = platform_settings(cdc_database, server.url, message_mode=mode)
    for attempt in range(2):  # the second start must not fail on what the first published
        async with running_bridge(settings):
            await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0)
            if attempt == 0:
                pg_admin.execute(f"INSERT INTO {table} VALUES (1, %s, 1), (2, 'small', 2)",
                                 (big,))
                pg_admin.execute(f"UPDATE {table} SET body = body || 'x', n = 3 WHERE id = 1")
                pg_admin.execute(f"INSERT INTO {table} VALUES (3, 'after', 3)")
            messages = await read_subjects(client, "CDC", f"cdc.{table}.>", expect=3)
    events = []
    for message in messages:
        payload = await resolve_payload(client.jetstream(), message.data, message.headers)
        decoded = decode_payload(payload, "msgpack")
        events += decoded if isinstance(decoded, list) else [decoded]
    assert [(e["operation"], e["data"]["id"]) for e in events] == [
        ("INSERT", 1), ("INSERT", 2), ("UPDATE", 1), ("INSERT", 3)]
    assert events[0]["data"]["body"] == big and events[2]["data"]["body"] == big + "x"
    claimed = [m for m in messages if HEADER_CLAIM_CHECK in (m.headers or {})]
    assert claimed and all(len(m.data) < 4096 for m in claimed)
    reference = decode_payload(claimed[0].data, "msgpack")
    if mode == "per-change":
        assert reference["claim_check"]["object"] == reference["msg_id"]
        assert "data" not in reference and reference["operation"] == "INSERT"
    assert reference["claim_check"]["size"] > SMALL_MAX_PAYLOAD
    # the slot moved past everything: nothing piles up
    assert slot_confirmed(pg_admin, cdc_database.slot) >= parse_lsn(events[-1]["commit_lsn"])
