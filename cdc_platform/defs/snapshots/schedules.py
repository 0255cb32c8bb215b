"""`snapshot_refresh_schedule`: refresh every published table's snapshot on a cron."""

import dagster as dg

from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES


def build_snapshot_refresh_schedule(snapshot_job, cron: str, timezone: str):
    @dg.schedule(job=snapshot_job, cron_schedule=cron, execution_timezone=timezone,
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="A fresh INIT snapshot of every published table "
                 "(cron: CDC_SNAPSHOT_CRON). Off until turned on.")
    def snapshot_refresh_schedule(context: dg.ScheduleEvaluationContext):
        tables = context.instance.get_dynamic_partitions(PUBLISHED_TABLES)
        if not tables:
            return dg.SkipReason("no published tables known yet (publication_sync_sensor)")
        stamp = context.scheduled_execution_time.isoformat()
        return [dg.RunRequest(run_key=f"refresh-{table}-{stamp}", partition_key=table)
                for table in tables]

    return snapshot_refresh_schedule
