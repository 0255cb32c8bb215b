"""`resync_sensor`: after the bridge replaced a lost slot (CDC_ON_SLOT_LOST=resync), verify
every published table, so that mirrors find and repair what the gap took instead of each
taking every table again (docs/verification.md "Item 6")."""

import asyncio

import dagster as dg
from nats.js.errors import NotFoundError

from cdc_platform.defs.resources import NatsResource, PostgresResource
from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES
from cdc_platform.defs.verification.assets import BITS_TAG
from cdc_platform.settings import NatsTopology, load_settings
from cdc_platform.wire import resync_subject
from cdc_platform.wire.digest import MAX_BUCKET_BITS


async def _last_resync_seq(nats: NatsResource, slot: str) -> int | None:
    """The stream sequence of the last resync marker of ``slot`` in CDC (None: none)."""
    async with nats.connect("cdc-platform-resync-sensor", as_sensor=True) as client:
        try:
            found = await client.jetstream().get_last_msg(
                load_settings(NatsTopology).cdc.name, resync_subject(slot))
        except NotFoundError:
            return None
        return found.seq


def build_resync_sensor(verification_job) -> dg.SensorDefinition:
    @dg.sensor(job=verification_job, minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="A verification of every published table after the bridge "
               "replaced a lost slot (a resync marker in CDC, CDC_ON_SLOT_LOST=resync).")
    def resync_sensor(context: dg.SensorEvaluationContext, nats: NatsResource,
                      postgres: PostgresResource):
        seq = asyncio.run(_last_resync_seq(nats, postgres.settings().slot))
        handled = int(context.cursor) if context.cursor else 0
        if seq is None or seq <= handled:
            return dg.SkipReason("no new resync marker in CDC")
        tables = context.instance.get_dynamic_partitions(PUBLISHED_TABLES)
        if not tables:  # (the cursor stays: the marker is handled once tables are known)
            return dg.SkipReason("no published tables known yet (publication_sync_sensor)")
        context.log.info(f"resync marker at CDC seq {seq}: verifying {len(tables)} tables")
        # one run per table per marker (the run key): a later marker verifies again. At the
        # finest bits a digest has: a lost slot's changes are many, and a mirror repairs
        # instead of bootstrapping again only while at most a quarter of the buckets differ
        # (at the default ~1,000 rows a bucket that is some 0.04 % of the rows changed)
        return dg.SensorResult(
            run_requests=[dg.RunRequest(run_key=f"resync-{seq}-{table}", partition_key=table,
                                        tags={BITS_TAG: str(MAX_BUCKET_BITS)})
                          for table in tables],
            cursor=str(seq))

    return resync_sensor
