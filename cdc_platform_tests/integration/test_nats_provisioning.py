"""Provisioning of streams and the KV bucket on a real nats-server."""

import asyncio
import time

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType
from nats.js.errors import APIError, NotFoundError

from cdc_platform.dev.servers import free_port
from cdc_platform.errors import ProvisioningError
from cdc_platform.jetstream.provision import REQUESTS_DURABLE, provision, stream_config
from cdc_platform.settings import NatsTopology
from cdc_platform_tests.fixtures.services import nats_server_from, random_name


def _isolated_topology(suffix: str, **cdc) -> NatsTopology:
    """Streams with their own names and subjects, so tests do not collide."""
    return NatsTopology(
        cdc={"name": f"CDC_{suffix}", "subjects": [f"{suffix}.cdc.>"], **cdc},
        init={"name": f"INIT_{suffix}", "subjects": [f"{suffix}.init.>"]},
        requests={"name": f"REQ_{suffix}", "subjects": [f"{suffix}.req.>"]},
        schemas={"bucket": f"schemas_{suffix}"},
        dictionaries={"bucket": f"dictionaries_{suffix}"},
        large={"bucket": f"large_{suffix}"},
        mirrors={"bucket": f"mirrors_{suffix}"},
    )


async def _delete(js, topology):
    for name in (topology.cdc.name, topology.init.name, topology.requests.name,
                 f"KV_{topology.schemas.bucket}", f"KV_{topology.dictionaries.bucket}",
                 f"OBJ_{topology.large.bucket}", f"KV_{topology.mirrors.bucket}"):
        await js.delete_stream(name)


async def test_creates_then_verifies(nats_client):
    js = nats_client.jetstream()
    topology = _isolated_topology("fresh")
    first = await provision(js, topology)
    second = await provision(js, topology)
    try:
        assert sorted(first.created) == ["CDC_fresh", "INIT_fresh", "REQ_fresh",
                                         f"consumer:REQ_fresh/{REQUESTS_DURABLE}",
                                         "kv:dictionaries_fresh", "kv:mirrors_fresh",
                                         "kv:schemas_fresh", "obj:large_fresh"]
        assert sorted(second.unchanged) == sorted(first.created)
        cdc = (await js.stream_info("CDC_fresh")).config
        assert cdc.subjects == ["fresh.cdc.>"]
        assert cdc.storage == StorageType.FILE and cdc.retention == RetentionPolicy.LIMITS
        assert cdc.max_age == 7 * 86400
        kv = await js.key_value("schemas_fresh")
        assert (await kv.status()).history == 10
        dictionaries = await js.key_value("dictionaries_fresh")
        assert (await dictionaries.status()).history == 1  # an id never names other bytes
        large = (await js.stream_info("OBJ_large_fresh")).config
        assert large.max_age == 7 * 86400  # claim checks live as long as CDC events
        mirrors = (await js.stream_info("KV_mirrors_fresh")).config
        assert (mirrors.max_msgs_per_subject, mirrors.max_age, mirrors.max_msg_size,
                mirrors.max_bytes) == (1, 120, 64 * 1024, 64 * 1024**2)
        # readers write it: no header of theirs may purge the bucket or outlive its TTL
        assert not mirrors.allow_rollup_hdrs and not mirrors.allow_msg_ttl
        state = await js.key_value("mirrors_fresh")
        await state.put("team_a.edge", b"{}")
        assert (await state.get("team_a.edge")).value == b"{}"
    finally:
        await _delete(js, topology)


async def test_default_topology_and_requests_kept_while_nobody_listens(provisioned_nats,
                                                                      nats_client):
    js = nats_client.jetstream()
    assert (await js.stream_info("CDC")).config.subjects == ["cdc.>"]
    assert (await js.stream_info("INIT")).config.subjects == ["init.>"]
    assert (await js.stream_info("SNAPSHOT_REQUESTS")).config.subjects == [
        "snapshot.request.>"]
    await js.key_value("schemas")
    await js.key_value("zstd_dictionaries")
    # a core-NATS request published while nothing listens is kept by the stream (stored
    # after the flush returns, not before: asked for until it is there, for up to 5 s)
    await nats_client.publish("snapshot.request.kept_table", b"")
    await nats_client.flush()
    deadline = time.monotonic() + 5.0
    while True:
        try:
            message = await js.get_last_msg("SNAPSHOT_REQUESTS", "snapshot.request.kept_table")
            break
        except NotFoundError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    assert message.subject == "snapshot.request.kept_table"


async def _last_data(js, stream: str, subject: str) -> bytes | None:
    try:
        return (await js.get_last_msg(stream, subject)).data
    except NotFoundError:
        return None


async def test_a_request_flood_pushes_out_no_other_tables_requests(provisioned_nats,
                                                                    nats_client):
    """Issue 13's flood: ~1 MB messages on ``snapshot.request.x`` pushed the genuine requests
    out of SNAPSHOT_REQUESTS in 0.7 s. Now the server refuses messages larger than a request
    can be, and a flood on one subject only displaces that subject's older messages."""
    js = nats_client.jetstream()
    stream = "SNAPSHOT_REQUESTS"
    genuine = f"snapshot.request.{random_name('genuine')}"
    flooded = f"snapshot.request.{random_name('flooded')}"
    try:
        await nats_client.publish(genuine, b'{"request_id": "mine"}')
        await nats_client.flush()
        with pytest.raises(APIError, match="message size exceeds maximum allowed"):
            await js.publish(flooded, b"x" * 1_000_000, stream=stream)
        for _ in range(70):  # core NATS, as an attacker would: not stored, no error to see
            await nats_client.publish(flooded, b"x" * 1_000_000)
        for number in range(500):
            await nats_client.publish(flooded, str(number).encode())
        await nats_client.flush()
        deadline = time.monotonic() + 10  # (core publishes: stored a moment after the flush)
        while await _last_data(js, stream, flooded) != b"499":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # the per-subject cap, counted on the flooded subject (the stream is shared with
        # other tests, whose requests may come meanwhile)
        on_flooded = (await js.stream_info(stream, subjects_filter=flooded)).state
        assert (on_flooded.subjects or {}).get(flooded, 0) <= 100
        assert (await js.stream_info(stream)).state.bytes < 1_000_000
        kept = await js.get_last_msg(stream, genuine)
        assert kept.data == b'{"request_id": "mine"}'
    finally:  # (other tests' sensors read this stream)
        for subject in (genuine, flooded):
            await js.purge_stream(stream, subject=subject)


async def test_update_moves_an_existing_request_stream_keeping_its_pending_requests(
        nats_client):
    """SNAPSHOT_REQUESTS as an older version left it (limits retention, discard old, the
    durable as the sensor made it): ``--update`` updates the durable first, then moves the
    stream to interest retention and discard new in place; the requests it held (one of
    them handled and acked already) are still pending."""
    js = nats_client.jetstream()
    topology = _isolated_topology("moved")
    old = stream_config(topology.requests)
    assert old.retention == RetentionPolicy.LIMITS and old.discard == DiscardPolicy.OLD
    await js.add_stream(old)
    try:
        sensor = await js.pull_subscribe(  # what the sensor did before provision made it
            "moved.req.>", durable=REQUESTS_DURABLE, stream="REQ_moved", config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=60, max_ack_pending=2000))
        for number in range(4):
            await js.publish(f"moved.req.table_{number}", b"")
        (handled,) = await sensor.fetch(1)
        await handled.ack_sync()
        with pytest.raises(ProvisioningError, match=r"REQ_moved\.retention: existing"):
            await provision(js, topology)
        report = await provision(js, topology, update=True)
        assert report.updated == [f"consumer:REQ_moved/{REQUESTS_DURABLE} (ack_wait)",
                                  "REQ_moved (retention, discard)"]
        info = await js.stream_info("REQ_moved")
        assert info.state.messages == 3  # the acked one left
        config = info.config
        assert config.retention == RetentionPolicy.INTEREST
        assert config.discard == DiscardPolicy.NEW
        consumer = await js.consumer_info("REQ_moved", REQUESTS_DURABLE)
        assert consumer.num_pending == 3 and consumer.config.ack_wait == 10
        assert consumer.config.filter_subject == "moved.req.>"
        assert f"consumer:REQ_moved/{REQUESTS_DURABLE}" in (await provision(
            js, topology)).unchanged
    finally:
        await _delete(js, topology)


async def test_a_full_request_stream_refuses_new_requests_and_keeps_pending_ones(
        nats_client):
    """Issue 24: a flood across many subjects (``snapshot.request.bogus_1..N``) pushed a real
    table's pending request out of the stream (discard old across the stream). Now the stream
    is full of pending requests only and refuses new ones, with an error a JetStream publish
    sees; per table, the limit still drops that table's own oldest request."""
    js = nats_client.jetstream()
    topology = _isolated_topology("full")
    topology = topology.model_copy(update={"requests": topology.requests.model_copy(
        update={"max_msgs": 20, "max_msgs_per_subject": 3})})
    await provision(js, topology)
    try:
        await js.publish("full.req.real", b'{"request_id": "mine"}')
        for number in range(3):
            await js.publish("full.req.repeated", str(number).encode())
        refused = None
        for number in range(40):
            try:
                await js.publish(f"full.req.bogus_{number}", b"")
            except APIError as exc:
                refused = exc
                break
        assert refused is not None and refused.err_code == 10077, refused
        assert refused.description == "maximum messages exceeded"
        assert (await js.get_last_msg("REQ_full", "full.req.real")).data == \
            b'{"request_id": "mine"}'
        # a table at its own limit: its newest request replaces its oldest, full or not
        await js.publish("full.req.repeated", b"3")
        assert (await js.stream_info("REQ_full", subjects_filter="full.req.repeated")
                ).state.subjects == {"full.req.repeated": 3}
        # the sensor acks what it handled: that leaves the stream, and room for new ones
        subscription = await js.pull_subscribe_bind(REQUESTS_DURABLE, "REQ_full")
        for message in await subscription.fetch(5):
            await message.ack_sync()
        await js.publish("full.req.later", b"")
    finally:
        await _delete(js, topology)


async def test_conflicting_config_is_reported_field_by_field(nats_client):
    js = nats_client.jetstream()
    topology = _isolated_topology("conflict", max_age_seconds=3600)
    await provision(js, topology)
    try:
        wanted = _isolated_topology("conflict", max_age_seconds=7200)
        with pytest.raises(ProvisioningError, match=r"CDC_conflict\.max_age: existing 3600"):
            await provision(js, wanted)
        report = await provision(js, wanted, update=True)
        assert report.updated == ["CDC_conflict (max_age)", "obj:large_conflict (ttl)"]
        assert (await js.stream_info("CDC_conflict")).config.max_age == 7200
    finally:
        await _delete(js, topology)


async def test_cdc_stream_allows_fast_ingest_batches(nats_client):
    js = nats_client.jetstream()
    topology = _isolated_topology("batched")
    await provision(js, topology)
    try:
        assert (await js.stream_info("CDC_batched")).config.allow_batched is True
        assert not (await js.stream_info("INIT_batched")).config.allow_batched
    finally:
        await _delete(js, topology)


async def test_a_server_without_room_for_the_streams_is_named_clearly(tmp_path):
    """The streams' max_bytes are reserved against the server's JetStream storage limit; one
    too small for them is refused with a line saying what to change, not nats' bare
    "insufficient storage resources available"."""
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\n"
                      f'jetstream {{ store_dir: "{tmp_path / "js"}", max_file_store: 1GB }}\n')
    with nats_server_from(config, port, tmp_path / "nats.log"):
        client = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            with pytest.raises(ProvisioningError, match=r"cannot reserve stream CDC's "
                               r"max_bytes \(8.0 GiB\).*max_file_store.*CDC_STREAM_MAX_BYTES"):
                await provision(client.jetstream(), NatsTopology())
        finally:
            await client.close()
