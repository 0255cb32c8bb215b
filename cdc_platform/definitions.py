"""The one Dagster `Definitions` object of the platform (loaded by workspace.yaml).

Only non-secret knobs are read here (slot name for the run tag, cron, Spark master); every
connection setting and credential is read from the environment by the resources at run time.
"""

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from cdc_platform.defs.cdc.assets import cdc_stream
from cdc_platform.defs.cdc.jobs import build_cdc_job
from cdc_platform.defs.cdc.sensors import build_cdc_sensor
from cdc_platform.defs.fleet.assets import mirror_fleet, mirrors_equal_source, mirrors_fresh
from cdc_platform.defs.fleet.sensors import build_mirror_fleet_sensor
from cdc_platform.defs.platform.assets import jetstream_topology
from cdc_platform.defs.resources import (
    CdcResource,
    NatsRepliesResource,
    NatsResource,
    PostgresResource,
)
from cdc_platform.defs.schemas.assets import schemas
from cdc_platform.defs.snapshots.assets import SNAPSHOT_KIND_TAG, init_snapshot
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.defs.snapshots.schedules import build_snapshot_refresh_schedule
from cdc_platform.defs.snapshots.sensors import (
    build_snapshot_request_sensor,
    publication_sync_sensor,
)
from cdc_platform.defs.verification.assets import table_verification
from cdc_platform.defs.verification.repairs import table_repair
from cdc_platform.defs.verification.schedules import build_verification_schedule
from cdc_platform.defs.verification.sensors import build_resync_sensor
from cdc_platform.settings import OrchestrationSettings, PostgresSettings, load_settings
from cdc_platform.snapshot.spark_session import default_spark_config


def build_definitions() -> dg.Definitions:
    orchestration = load_settings(OrchestrationSettings)
    slot = load_settings(PostgresSettings).slot
    cdc_job = build_cdc_job(slot)
    snapshot_job = dg.define_asset_job(
        "snapshot_job", selection=[init_snapshot], tags={SNAPSHOT_KIND_TAG: "snapshot"},
        description="INIT snapshot of one table (partition = wire table name).")
    verification_job = dg.define_asset_job(
        # (not mirrors_equal_source: mirrors meet a verification after its run, and the
        # sensor reports the check as they do)
        "verification_job", selection=dg.AssetSelection.assets(table_verification).without_checks(),
        tags={SNAPSHOT_KIND_TAG: "verification"},
        description="The source's digest of one table for mirrors to compare with "
        "(partition = wire table name).")
    mirrors_equal_source_job = dg.define_asset_job(
        "mirrors_equal_source_job", selection=dg.AssetSelection.assets(table_verification),
        partitions_def=published_tables_partitions,
        description="mirror_fleet_sensor runs it with only the check mirrors_equal_source "
        "selected, for a table whose mirrors' verdict changed (run whole, it also verifies "
        "the table).")
    repair_job = dg.define_asset_job(
        "repair_job", selection=[table_repair], tags={SNAPSHOT_KIND_TAG: "repair"},
        description="A repair snapshot of some buckets of one table, for mirrors' repair "
        "requests (partition = wire table name).")
    return dg.Definitions(
        assets=[jetstream_topology, schemas, init_snapshot, cdc_stream, table_verification,
                table_repair, mirror_fleet],
        asset_checks=[mirrors_fresh, mirrors_equal_source],
        jobs=[cdc_job, snapshot_job, verification_job, repair_job, mirrors_equal_source_job],
        sensors=[build_cdc_sensor(cdc_job, orchestration.cdc_relaunch_backoff_seconds,
                                 orchestration.cdc_liveness_timeout_seconds),
                 build_snapshot_request_sensor(snapshot_job, verification_job, repair_job),
                 publication_sync_sensor, build_resync_sensor(verification_job),
                 build_mirror_fleet_sensor(mirrors_equal_source_job)],
        schedules=[build_snapshot_refresh_schedule(
            snapshot_job, orchestration.snapshot_cron, orchestration.snapshot_timezone),
            build_verification_schedule(verification_job, orchestration.verify_cron,
                                        orchestration.snapshot_timezone)],
        resources={
            # where the servers are and the credentials: the environment's, at run time
            # (never run config: it could send them to another host)
            "postgres": PostgresResource(),
            "nats": NatsResource(),
            "nats_replies": NatsRepliesResource(),
            "cdc": CdcResource(),
            "pyspark": LazyPySparkResource(spark_config=default_spark_config(
                orchestration.spark_master, orchestration.spark_driver_memory)),
        },
    )


defs = build_definitions()
