"""A lost slot (its WAL removed past max_slot_wal_keep_size) on a real server: by default the
bridge stops and says what to do; with CDC_ON_SLOT_LOST=resync it stores a resync marker in
CDC before anything from a new slot, drops the lost slot and streams from a new one
(docs/verification.md "Item 6")."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.dev.servers import start_logical_postgres
from cdc_platform.errors import SlotLostError
from cdc_platform.lsn import parse_lsn
from cdc_platform.postgres.admin import provision_database
from cdc_platform.replication.slots import read_slot
from cdc_platform.wire import ResyncMarker, decode_payload, in_field_order, resync_subject
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.services import (
    CdcDatabase,
    platform_settings,
    random_name,
    read_subjects,
    secret_for_test,
)
from cdc_platform_tests.fixtures.slots import lose_slot


@pytest.mark.every_major
async def test_a_lost_slot_stops_the_bridge_or_is_marked_and_replaced(server_dir,
                                                                    provisioned_nats,
                                                                    nats_client):
    server = start_logical_postgres(server_dir / "pg", unsafe_no_fsync=True)
    try:
        admin = psycopg.connect(server.superuser_conninfo(), autocommit=True)
        admin.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        admin.execute("ALTER SYSTEM SET max_wal_size = '32MB'")
        admin.execute("ALTER SYSTEM SET min_wal_size = '32MB'")
        admin.execute("SELECT pg_reload_conf()")
        table = random_name("resync")
        admin.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, note text)")
        database = CdcDatabase(server=server, publication=random_name("pub"),
                               role=random_name("reader"), password=secret_for_test(),
                               slot=random_name("slot"))
        provision_database(admin, publication=database.publication, role=database.role,
                           tables=[table], role_password=database.password)
        subject = f"cdc.{table}.>"

        async with running_bridge(platform_settings(database, provisioned_nats.url)) as bridge:
            await bridge_ready(admin, database, bridge.settings, [table])
            admin.execute(f"INSERT INTO {table} (note) VALUES ('kept')")
            await read_subjects(nats_client, "CDC", subject, expect=1)
        confirmed = read_slot(admin, database.slot).confirmed_flush_lsn
        admin.execute(f"INSERT INTO {table} (note) VALUES ('lost')")
        lose_slot(admin, database.slot, table)

        # the default: stop, saying what to do; the slot is left as it is
        stopping = CdcBridge(platform_settings(database, provisioned_nats.url))
        with pytest.raises(SlotLostError, match="invalidated"):
            await asyncio.wait_for(stopping.run(), 60)
        assert read_slot(admin, database.slot).lost

        # resync: a marker, then the new slot's stream
        resyncing = platform_settings(database, provisioned_nats.url, on_slot_lost="resync")
        async with running_bridge(resyncing) as bridge:
            await wait_for(lambda: bridge.metrics.status()["slot_resyncs"] == 1, timeout=60,
                           what="the resync")
            await wait_for(lambda: (state := read_slot(admin, database.slot)) is not None
                           and not state.lost, what="a new slot")
            admin.execute(f"INSERT INTO {table} (note) VALUES ('after')")
            after = await read_subjects(nats_client, "CDC", subject, expect=2)
            assert bridge.metrics.status()["last_resync_lost_after"] is not None
        markers = await read_subjects(nats_client, "CDC", resync_subject(database.slot))
        assert len(markers) == 1
        marker = decode_payload(markers[0].data, "msgpack")
        assert marker == in_field_order(ResyncMarker, marker)
        assert parse_lsn(marker["lost_after"]) == confirmed
        assert markers[0].headers["Nats-Msg-Id"] == marker["msg_id"]
        notes = [decode_payload(m.data, "msgpack")["data"]["note"] for m in after]
        assert notes == ["kept", "after"]  # what the gap took is not in the stream ...
        # ... and everything from the new slot comes after the marker
        assert markers[0].metadata.sequence.stream < after[1].metadata.sequence.stream
        admin.close()
    finally:
        server.stop()
