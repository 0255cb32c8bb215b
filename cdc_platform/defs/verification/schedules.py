"""`verification_schedule`: verify every published table on a cron (CDC_VERIFY_CRON)."""

import dagster as dg

from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES

# the cron shown while CDC_VERIFY_CRON is unset (the schedule is off then)
UNSET_CRON = "0 4 * * *"


def build_verification_schedule(verification_job, cron: str | None, timezone: str):
    @dg.schedule(job=verification_job, cron_schedule=cron or UNSET_CRON,
                 execution_timezone=timezone,
                 default_status=dg.DefaultScheduleStatus.RUNNING if cron
                 else dg.DefaultScheduleStatus.STOPPED,
                 description="A verification of every published table (cron: "
                 "CDC_VERIFY_CRON; off while it is unset).")
    def verification_schedule(context: dg.ScheduleEvaluationContext):
        tables = context.instance.get_dynamic_partitions(PUBLISHED_TABLES)
        if not tables:
            return dg.SkipReason("no published tables known yet (publication_sync_sensor)")
        stamp = context.scheduled_execution_time.isoformat()
        return [dg.RunRequest(run_key=f"verify-{table}-{stamp}", partition_key=table)
                for table in tables]

    return verification_schedule
