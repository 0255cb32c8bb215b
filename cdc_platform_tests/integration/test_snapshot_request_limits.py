"""Snapshot requests as a requester sees them (docs/wire-contract.md "Snapshots"): a body over 4 KB
is refused with the limit, one over the stream's message limit gets the server's error, and a
requester that gets no ``done`` knows which meta answers it."""

from __future__ import annotations

import asyncio
import json

from cdc_platform.consumer.snapshots import snapshot_stored_since
from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.snapshot import snapshot_table
from cdc_platform.snapshot.requests import answer_requests, parse_request
from cdc_platform_tests.fixtures.bridge import running_bridge
from cdc_platform_tests.fixtures.services import platform_settings, random_name


def _body(size: int, **fields) -> bytes:
    """A JSON request body of exactly ``size`` bytes."""
    body = json.dumps({**fields, "padding": ""}).encode()
    return body.replace(b'"padding": ""', b'"padding": "' + b"x" * (size - len(body)) + b'"')


async def test_a_body_over_4_kb_is_refused_with_the_limit(provisioned_nats, nats_client):
    table = random_name("big_ask")
    inbox = nats_client.new_inbox()
    replies: asyncio.Queue = asyncio.Queue()
    await nats_client.subscribe(inbox, cb=replies.put)
    body = _body(5_100, request_id="r1", reply_to=inbox)
    assert len(body) == 5_100
    await nats_client.jetstream().publish(f"snapshot.request.{table}", body)
    stored = await nats_client.jetstream().get_last_msg("SNAPSHOT_REQUESTS",
                                                        f"snapshot.request.{table}")
    request = parse_request(stored.subject, stored.data, stored.seq)
    await answer_requests(nats_client, [request], published={table}, publication="pub",
                          reuse_seconds=0, in_flight={})
    reply = json.loads((await asyncio.wait_for(replies.get(), 10)).data)
    assert reply["status"] == "refused" and reply["request_id"] == "r1"
    assert "5,100 bytes, over the 4,096-byte limit" in reply["reason"]


async def test_a_body_over_the_stream_limit_gets_the_servers_error(provisioned_nats,
                                                                     nats_client):
    """Never stored, so never seen by the platform: a request with a reply subject (as a
    JetStream publish makes) gets the server's error; a bare publish gets nothing."""
    table = random_name("huge_ask")
    answer = await nats_client.request(f"snapshot.request.{table}",
                                       _body(9_100, reply_to="x.y"), timeout=5)
    error = json.loads(answer.data)["error"]
    assert error["err_code"] == 10054, error  # JSStreamMessageExceedsMaximumErr


async def test_a_requester_without_done_waits_for_a_meta_stored_after_it_asked(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """The rule of docs/wire-contract.md "Snapshot requests" for a requester answered ``coalesced``:
    the newest meta whose INIT sequence is above INIT's last sequence read before asking, with an
    ``lsn`` of at least its ``min_lsn``; a snapshot stored before it asked does not answer it
    (whatever its age), one stored after does."""
    table = random_name("coalesced")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 10)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    js = nats_client.jetstream()
    async with running_bridge(settings):
        before = await snapshot_table(None, settings, table)
        asked_after = (await js.stream_info("INIT")).state.last_seq
        assert await snapshot_stored_since(js, table, asked_after) is None
        after = await snapshot_table(None, settings, table)
        found = await snapshot_stored_since(js, table, asked_after)
        assert found is not None and found["snapshot_id"] == after.snapshot_id
        assert found["meta_seq"] == after.meta_seq and found["lsn"] == after.lsn
        assert before.snapshot_id != after.snapshot_id
        higher = format_lsn(parse_lsn(after.lsn) + 1)
        assert await snapshot_stored_since(js, table, asked_after,
                                           min_lsn=parse_lsn(higher)) is None
