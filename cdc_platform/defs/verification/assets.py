"""`table_verification`, partitioned by table: the source's digest of one table published on
`cdc.cdc-platform.verify.{table}.{id}` for mirrors to compare with (docs/verification.md)."""

import json

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from cdc_platform.defs.resources import (
    CdcResource,
    NatsRepliesResource,
    NatsResource,
    PostgresResource,
)
from cdc_platform.defs.snapshots.assets import REPLIES_TAG, SNAPSHOT_KIND_TAG, answer_requesters
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.settings import OrchestrationSettings, load_settings
from cdc_platform.snapshot.requests import Reply, verification_done_fields
from cdc_platform.snapshot.spark_session import prepare_spark_environment

# what a run started by verify requests digests (snapshot_request_sensor sets them)
BITS_TAG = "cdc_platform/verify_bits"
BUCKETS_TAG = "cdc_platform/verify_buckets"  # a JSON list


@dg.asset(
    group_name="verification",
    partitions_def=published_tables_partitions,
    kinds={"spark", "nats", "postgres"},
    op_tags={SNAPSHOT_KIND_TAG: "verification"},
    deps=["init_snapshot"],
)
def table_verification(context: dg.AssetExecutionContext, postgres: PostgresResource,
                       nats: NatsResource, nats_replies: NatsRepliesResource,
                       cdc: CdcResource, pyspark: LazyPySparkResource) -> dg.MaterializeResult:
    """The table's digest at an exact point of the CDC stream (`lsn`: every transaction
    committed below it, none above), published on `cdc.cdc-platform.verify.{table}.{id}`
    after all of them; mirrors compare their copy with it."""
    from cdc_platform.snapshot.options import SnapshotOptions
    from cdc_platform.verify import run_verification

    table = context.partition_key
    settings = cdc.platform_settings(postgres, nats)
    options = SnapshotOptions(
        small_table_bytes=load_settings(OrchestrationSettings).snapshot_local_max_bytes)
    tags = context.run.tags
    requesters = json.loads(tags.get(REPLIES_TAG, "[]"))
    bits = int(tags[BITS_TAG]) if BITS_TAG in tags else None
    buckets = json.loads(tags[BUCKETS_TAG]) if BUCKETS_TAG in tags else None

    def spark_session():  # started only for a table too large to read here
        prepare_spark_environment()
        return pyspark.spark_session

    try:
        result = run_verification(spark_session, settings, table, bits=bits, buckets=buckets,
                                  options=options)
    except Exception as exc:
        answer_requesters(nats_replies, requesters, Reply("failed", table, fields={
            "reason": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            "run_id": context.run.run_id}))
        raise
    answer_requesters(nats_replies, requesters,
                      Reply("done", table, fields=verification_done_fields(result)))
    context.log.info(f"verification {result.verification_id} of {table}: {result.row_count} "
                     f"rows at {result.bits} bits, lsn {result.lsn}, digest seq "
                     f"{result.digest_seq}")
    return dg.MaterializeResult(metadata={
        "verification_id": result.verification_id,
        "lsn": result.lsn,
        "bits": dg.MetadataValue.int(result.bits),
        "buckets": dg.MetadataValue.json(list(result.buckets))
        if result.buckets is not None else dg.MetadataValue.null(),
        "row_count": dg.MetadataValue.int(result.row_count),
        "rows_per_second": dg.MetadataValue.float(round(result.rows_per_second, 1)),
        "digest_subject": result.digest_subject,
        "digest_seq": dg.MetadataValue.int(result.digest_seq),
        "marker_subject": result.marker_subject,
        "schema_fingerprint": result.schema_fingerprint,
        "duration_seconds": dg.MetadataValue.float(result.duration_seconds),
    })
