"""Signed messages (docs/wire-contract.md "Signatures") against real servers: a bridge holding a
signing key signs what it publishes; a mirror trusting that key applies it and refuses what anyone
else stores in `CDC` (the test nats-server has no permissions, as a server whose publish rights
leak), staying exact, with no position moved, also after a restart."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time

import msgpack
import pytest

from cdc_platform.consumer.snapshots import (
    SnapshotMeta,
    SnapshotUnusable,
    cutover_start_seq,
    latest_meta,
)
from cdc_platform.jetstream.kv import verified_value
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.follower import Mirror, _commit_lsn_at
from cdc_platform.mirror.snapshots import read_chunks
from cdc_platform.settings import BridgeSettings, MirrorSettings
from cdc_platform.snapshot import SnapshotOptions, new_snapshot_id, snapshot_table
from cdc_platform.snapshot.chunks import chunk_number
from cdc_platform.wire import (
    HEADER_SIGNATURE,
    HEADER_SIGNING_KEY,
    MessageSigner,
    SignatureVerifier,
    chunk_msg_id,
    snapshot_chunk_subject,
    watermark_msg_id,
    watermark_subject,
)
from cdc_platform.wire.signing import new_seed
from cdc_platform_tests.exactness import bridge_caught_up, mirror_rows, source_rows
from cdc_platform_tests.fixtures.bridge import (
    bridge_ready,
    running_bridge,
    slot_confirmed,
    wait_for,
)
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects
from cdc_platform_tests.fixtures.snapshots import (
    NO_BRIDGE,
    create_types_table,
    settings_for,
)

# the audit's forged event: a well-formed INSERT whose commit LSN is above any real one
FORGED_LSN = "7FFFFFFF/FFFFFF00"


def _event(table: str, operation: str, commit_lsn: str, **fields) -> dict:
    return {"table": table, "schema": "public", "operation": operation, "relation_id": 1,
            "lsn": commit_lsn, "commit_lsn": commit_lsn, "xid": 1,
            "commit_ts": "2026-11-25T00:00:00Z", "ordinal": 0, "msg_id": f"{commit_lsn}:0",
            "subject": f"cdc.{table}.{operation.lower()}", "unchanged_toast": [],
            "tx_tables": {table: 1}, **fields}


async def _forged_messages(nats_client, table: str, lsn: str) -> list[tuple[str, bytes, dict]]:
    """(subject, payload, headers) a forger stores: unsigned events (a TRUNCATE, the audit's
    INSERT), one signed by a key nobody trusts, and a genuine signed message stored again
    under another subject and id."""
    untrusted = MessageSigner(new_seed(os.urandom(32)))
    truncate = msgpack.packb(_event(table, "TRUNCATE", lsn, data=None, cascade=False,
                                    restart_identity=False))
    insert = msgpack.packb(_event(table, "INSERT", FORGED_LSN, data={"id": 1000, "v": "forged"}))
    other_insert = msgpack.packb(_event(table, "INSERT", lsn, ordinal=0,
                                        data={"id": 1001, "v": "forged"}))
    subject = f"cdc.{table}.insert"
    genuine = await nats_client.jetstream().get_last_msg("CDC", f"cdc.{table}.>")
    assert genuine.headers and HEADER_SIGNATURE in genuine.headers, genuine.headers
    return [
        (f"cdc.{table}.truncate", truncate, {"Nats-Msg-Id": f"{lsn}:0"}),
        # (the id made unique: the stream drops a second one within its duplicate window)
        (subject, insert, {"Nats-Msg-Id": f"{FORGED_LSN}:0:{table}"}),
        (subject, other_insert, {
            "Nats-Msg-Id": f"{lsn}:1", HEADER_SIGNING_KEY: untrusted.public_key,
            HEADER_SIGNATURE: untrusted.signature(subject, f"{lsn}:1", {}, other_insert)}),
        (f"cdc.{table}.truncate", genuine.data,
         {**genuine.headers, "Nats-Msg-Id": f"{lsn}:2"}),
    ]


def _positions(db) -> tuple[list[int], int | None]:
    """Every table's high-water commit LSN, and the file's consistent LSN."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        marks = [row[0] for row in connection.execute(
            "SELECT applied_commit_lsn FROM _cdc_mirror_tables")]
        consistent = connection.execute(
            "SELECT lsn_int FROM _cdc_mirror_consistent_lsn").fetchone()
    return marks, consistent[0] if consistent else None


@pytest.mark.every_major
@pytest.mark.parametrize(("message_mode", "publish_mode"),
                         [("per-change", "fast-batch"), ("batched", "per-message")])
async def test_a_mirror_trusting_the_bridge_key_refuses_forged_events_and_stays_exact(
        message_mode, publish_mode, cdc_database, pg_admin, provisioned_nats, nats_client,
        tmp_path, caplog):
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)) + "\n")
    public_key = MessageSigner(seed_file.read_text()).public_key
    table = random_name("signed")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 40) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url, message_mode=message_mode,
                                 publish_mode=publish_mode, signing_key_seed=str(seed_file))
    options = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0,
                             trusted_keys=f"{MessageSigner(new_seed(os.urandom(32))).public_key},"
                                          f"{public_key}")  # (two: a key rotation)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "m.db"
    lines: list[str] = []

    async def mirrored() -> Mirror:
        mirror = Mirror(settings, [table], db, options=options, report=lines.append)
        await mirror.run(until_caught_up=True)
        assert mirror_rows(db, table, ["id", "v"]) == source_rows(conninfo, table, ["id", "v"])
        return mirror

    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await mirrored()
        pg_admin.execute(f"UPDATE {table} SET v = 'signed' WHERE id <= 3")
        # (enough messages at once for the mirror to verify them on several threads)
        pg_admin.execute(f"UPDATE {table} SET v = v || ' bulk' WHERE id > 3")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        lsn = pg_admin.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
        forged = await _forged_messages(nats_client, table, lsn)
        for subject, payload, headers in forged:
            await nats_client.jetstream().publish(subject, payload, stream="CDC",
                                                  headers=headers)
        pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id BETWEEN 4 AND 6")
        pg_admin.execute(f"INSERT INTO {table} VALUES (41, 'new')")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        with caplog.at_level(logging.ERROR, logger="cdc_platform.mirror.follower"):
            following = await mirrored()
        refusals = [r.getMessage() for r in caplog.records if "refused message" in r.getMessage()]
        assert following.refused_messages == len(forged) == len(refusals), refusals
        assert sum("not signed" in refusal for refusal in refusals) == 2, refusals
        assert sum("not a trusted key" in refusal for refusal in refusals) == 1, refusals
        assert sum("bad signature" in refusal for refusal in refusals) == 1, refusals
        marks, consistent = _positions(db)
        source_lsn = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        assert marks and max(marks) <= source_lsn and (consistent or 0) <= source_lsn, \
            (marks, consistent)
        # a restart: the forged messages moved nothing it resumes from; it keeps following
        pg_admin.execute(f"DELETE FROM {table} WHERE id = 7")
        pg_admin.execute(f"UPDATE {table} SET v = 'restarted' WHERE id = 41")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await mirrored()
    marks, consistent = _positions(db)
    assert max(marks) < parse_lsn(FORGED_LSN) and (consistent or 0) < parse_lsn(FORGED_LSN)
    assert not any("bootstrapping again" in line for line in lines), lines


async def test_a_forged_watermark_marker_or_last_message_moves_no_point(
        provisioned_nats, nats_client):
    """The two places the mirror reads a position from a message of `CDC` outside its
    follow loop: a snapshot's cutover (step 2 of the rule: the last message on the
    watermark subject) and where idle tables meet (the stream's last message). A forged
    marker stored after the genuine one would start the table past changes it needs; a
    forged last event would put the meeting point at its LSN."""
    js = nats_client.jetstream()
    signer = MessageSigner(new_seed(os.urandom(32)))
    verifier = SignatureVerifier([signer.public_key])
    snapshot_id = random_name("snap")
    subject = watermark_subject(snapshot_id)
    marker = msgpack.packb({"type": "watermark", "snapshot_id": snapshot_id})
    msg_id = watermark_msg_id(snapshot_id)
    genuine = await js.publish(subject, marker, stream="CDC", headers={
        "Nats-Msg-Id": msg_id, HEADER_SIGNING_KEY: signer.public_key,
        HEADER_SIGNATURE: signer.signature(subject, msg_id, {}, marker)})
    await js.publish(subject, marker, stream="CDC", headers={"Nats-Msg-Id": f"{msg_id}:forged"})
    meta = SnapshotMeta(
        table="t", snapshot_id=snapshot_id, lsn=1, batch_count=0, row_count=0,
        cdc_stream="CDC", cdc_start_seq=None, watermark_subject=subject,
        chunk_subject_prefix="init.snap.t", schema_fingerprint="", format="msgpack",
        timestamp=0.0, raw={})
    assert await cutover_start_seq(js, meta, verifier) <= genuine.seq
    assert await cutover_start_seq(js, meta) > genuine.seq  # (what it was before)

    table = random_name("idle")
    forged = await js.publish(
        f"cdc.{table}.insert", msgpack.packb(_event(table, "INSERT", FORGED_LSN, data={"id": 1})),
        stream="CDC", headers={"Nats-Msg-Id": f"{FORGED_LSN}:0:{table}"})
    assert await _commit_lsn_at(js, "CDC", forged.seq, verifier) is None
    assert await _commit_lsn_at(js, "CDC", forged.seq, None) == parse_lsn(FORGED_LSN)


async def test_a_forged_snapshot_is_neither_handed_out_nor_loaded(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, caplog):
    """A whole snapshot forged into `INIT` (a meta newer than the genuine one and its chunk,
    rows of the forger's choosing): the snapshot sensor does not hand it out and a mirror
    trusting the key does not load it; the table is bootstrapped from a genuine one."""
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)))
    table = random_name("snapped")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 30) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 signing_key_seed=str(seed_file))
    options = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0,
                             trusted_keys=MessageSigner(seed_file.read_text()).public_key)
    conninfo = cdc_database.server.superuser_conninfo()
    js = nats_client.jetstream()
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings) as taken:
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], tmp_path / "first.db", options=options,
                     report=lines.append).run(until_caught_up=True)
        genuine = await js.get_last_msg("INIT", f"init.meta.{table}")
        assert HEADER_SIGNATURE in (genuine.headers or {})
        meta = msgpack.unpackb(genuine.data)
        forged_id = f"{meta['snapshot_id']}-forged"
        prefix = f"init.snap.{table}.{forged_id}."
        chunk = {"table": table, "operation": "snapshot", "snapshot_id": forged_id, "chunk": 0,
                 "lsn": meta["lsn"], "data": [{"id": 1, "v": "forged"}], "partition": 0,
                 "schema_fingerprint": meta["schema_fingerprint"]}
        await js.publish(f"{prefix}0", msgpack.packb(chunk), stream="INIT", headers={
            "Nats-Msg-Id": f"{forged_id}:0", "Content-Type": "application/msgpack",
            "Cdc-Schema-Fingerprint": meta["schema_fingerprint"]})
        await js.publish(f"init.meta.{table}", msgpack.packb({
            **meta, "snapshot_id": forged_id, "chunk_subject_prefix": prefix,
            "batch_count": 1, "row_count": 1, "chunks": [[0, 0, 1]],
            "timestamp": int(time.time())}), stream="INIT",
            headers={"Nats-Msg-Id": f"{forged_id}:meta", "Content-Type": "application/msgpack"})
        with caplog.at_level(logging.ERROR):
            await Mirror(settings, [table], tmp_path / "second.db", options=options,
                         report=lines.append).run(until_caught_up=True)
    assert mirror_rows(tmp_path / "second.db", table, ["id", "v"]) == source_rows(
        conninfo, table, ["id", "v"])
    assert len(taken) == 2, lines  # the first mirror's, and one instead of the forged one
    assert any("refused the snapshot meta" in r.getMessage() for r in caplog.records)
    # the table's KV schema, signed by the bridge; one put by someone else is not taken
    verifier = SignatureVerifier([options.trusted_keys])
    genuine_schema = await verified_value(js, "schemas", table, verifier)
    assert genuine_schema is not None
    await (await js.key_value("schemas")).put(table, genuine_schema)
    assert await verified_value(js, "schemas", table, verifier) is None



@pytest.mark.spark
async def test_spark_tasks_sign_chunks_and_a_forged_dictionary_is_not_used(
        pg_admin, cdc_database, provisioned_nats, nats_client, spark_session, tmp_path):
    """Chunks written by Spark executors (the seed travels in their task spec) verify, and
    so does the table's zstd dictionary; one replaced in KV, whose bytes would decide what
    the chunks decompress to, makes the snapshot unusable instead of read."""
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)))
    verifier = SignatureVerifier([MessageSigner(seed_file.read_text()).public_key])
    table = random_name("zstd_signed")
    create_types_table(pg_admin, table, 3_000)
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, zstd=True, chunk_rows=500)
    settings = settings.model_copy(update={"bridge": BridgeSettings(
        http_port=0, signing_key_seed=str(seed_file))})
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE)
    assert result.dictionary_id is not None and result.batch_count > 1
    js = nats_client.jetstream()
    meta = await latest_meta(js, table, verifier=verifier)
    assert meta is not None and meta.snapshot_id == result.snapshot_id
    rows = 0
    async for chunk in read_chunks(js, meta, verifier=verifier):
        rows += len(chunk.rows)
    assert rows == 3_000

    kv = await js.key_value("zstd_dictionaries")
    key = f"{table}.{result.dictionary_id}"
    genuine = (await kv.get(key)).value
    await kv.put(key, genuine[:-256] + bytes(256))  # its header and id kept
    with pytest.raises(SnapshotUnusable, match="signed by a trusted key"):
        async for _ in read_chunks(js, meta, verifier=verifier):
            pass


@pytest.mark.parametrize("mode", ["per-change", "batched"])
async def test_a_claim_check_stand_in_is_signed_with_its_header(
        mode, small_nats, cdc_database, pg_admin, tmp_path):
    """A row over max_payload travels as a claim check: its stand-in is signed, the
    ``Cdc-Claim-Check`` header included, like every other message of the stream."""
    server, client = small_nats
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)))
    verifier = SignatureVerifier([MessageSigner(seed_file.read_text()).public_key])
    table = random_name("large_signed")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, server.url, message_mode=mode,
                                 signing_key_seed=str(seed_file))
    async with running_bridge(settings):
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0)
        pg_admin.execute(f"INSERT INTO {table} VALUES (1, %s), (2, 'small')",
                         ("".join(f"{i:08d}" for i in range(40_000)),))
        messages = await read_subjects(client, "CDC", f"cdc.{table}.>", expect=1)
    claimed = [m for m in messages if "Cdc-Claim-Check" in (m.headers or {})]
    assert claimed, messages
    for message in messages:
        assert verifier.refusal(message.subject, message.headers or {}, message.data) is None
    forged = {**claimed[0].headers, "Cdc-Claim-Check": "cdc_large/another"}
    assert "bad signature" in verifier.refusal(claimed[0].subject, forged, claimed[0].data)


async def test_a_chunk_id_taken_before_its_chunk_is_sent_loses_no_chunk(
        pg_admin, cdc_database, provisioned_nats, nats_client, tmp_path, caplog):
    """Someone able to publish into `init.>` takes the id of a chunk before the snapshot's
    task sends it (ids are predictable once a snapshot's first chunk is out). JetStream drops
    the genuine chunk as a duplicate of that message: the task reads back what holds the id and,
    finding other content, stores the chunk again under a conflict id (docs/wire-contract.md
    "Message ids taken by other content"), signed; a mirror trusting the key reads past the forged
    one and loads every row."""
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)))
    verifier = SignatureVerifier([MessageSigner(seed_file.read_text()).public_key])
    table = random_name("taken_chunk")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 10) g")
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 signing_key_seed=str(seed_file))
    snapshot_id, first = new_snapshot_id(), chunk_number(0, 0)
    js = nats_client.jetstream()
    await js.publish(snapshot_chunk_subject(table, snapshot_id, first), b"forged",
                     stream="INIT", headers={"Nats-Msg-Id": chunk_msg_id(snapshot_id, first)})
    with caplog.at_level(logging.ERROR):
        # a small table: its range task runs here, through the same publishing as on Spark
        result = await snapshot_table(None, settings, table, snapshot_id=snapshot_id,
                                      options=SnapshotOptions(watermark_wait_seconds=0.2))
    assert result.ranges[0].first_chunk == first and result.ranges[0].duplicates == 0
    assert any("duplicate conflict on stream INIT" in r.getMessage()
               and chunk_msg_id(snapshot_id, first) in r.getMessage() for r in caplog.records)
    meta = await latest_meta(js, table, verifier=verifier)
    assert meta is not None and meta.snapshot_id == snapshot_id
    rows = [row async for chunk in read_chunks(js, meta, verifier=verifier)
            for row in chunk.rows]
    assert sorted(row["id"] for row in rows) == list(range(1, 11))
