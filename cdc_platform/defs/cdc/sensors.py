"""`cdc_sensor`: keeps exactly one cdc_job run alive, relaunching after failures with backoff.

A run is alive while its worker says so: the op writes the run tag `LIVENESS_TAG` every
few seconds. A STARTED run whose tag is older than the liveness timeout lost its worker
(SIGKILL, a crashed daemon or host): Dagster's DefaultRunLauncher cannot tell (it has no
worker health check), so the sensor marks the run failed and launches a new one. A run stuck
in CANCELING is ended by Dagster's run monitoring (`dagster.yaml`).
"""

import json
import time

import dagster as dg

from cdc_platform.defs.cdc.jobs import LIVENESS_TAG

ALIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
         dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
         dg.DagsterRunStatus.CANCELING]
MAX_BACKOFF_SECONDS = 600.0


def worker_silence(record: dg.RunRecord, now: float) -> float:
    """Seconds since the run's worker last showed it is alive (since the run started when
    it never did)."""
    tag = record.dagster_run.tags.get(LIVENESS_TAG)
    last = float(tag) if tag else (record.start_time or record.create_timestamp.timestamp())
    return now - last


def build_cdc_sensor(cdc_job: dg.JobDefinition, backoff_seconds: float,
                     liveness_timeout: float = 90.0) -> dg.SensorDefinition:
    @dg.sensor(job=cdc_job, minimum_interval_seconds=15,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Keeps one cdc_job run alive; relaunches after a failure with "
               "exponential backoff; the tick says why it did or did not launch.")
    def cdc_sensor(context: dg.SensorEvaluationContext):
        records = context.instance.get_run_records(
            dg.RunsFilter(job_name=cdc_job.name, statuses=ALIVE), limit=1)
        if records:
            record, run = records[0], records[0].dagster_run
            silent = worker_silence(record, time.time())
            if run.status != dg.DagsterRunStatus.STARTED or silent < liveness_timeout:
                return dg.SkipReason(f"cdc_job run {run.run_id} is {run.status.value}")
            message = (f"the run worker of cdc_job run {run.run_id} showed no sign of life "
                       f"for {silent:.0f}s (liveness timeout {liveness_timeout:.0f}s): "
                       "marked failed, a new run takes over the slot")
            context.log.warning(message)
            context.instance.report_run_failed(run, message=message)
        state = json.loads(context.cursor) if context.cursor else {"failures": 0,
                                                                     "launched_at": 0.0}
        last = context.instance.get_runs(dg.RunsFilter(job_name=cdc_job.name), limit=1)
        failures = state["failures"]
        if last and last[0].status == dg.DagsterRunStatus.FAILURE:
            if last[0].run_id != state.get("counted_run"):
                failures += 1
                state["counted_run"] = last[0].run_id
            wait = min(backoff_seconds * 2 ** (failures - 1), MAX_BACKOFF_SECONDS)
            remaining = state["launched_at"] + wait - time.time()
            if remaining > 0:
                context.update_cursor(json.dumps({**state, "failures": failures}))
                return dg.SkipReason(
                    f"last cdc_job run {last[0].run_id} failed ({failures} in a row); "
                    f"relaunching in {remaining:.0f}s")
            reason = f"relaunching after failed run {last[0].run_id} ({failures} in a row)"
        else:
            failures = 0
            reason = ("no cdc_job run yet" if not last else
                      f"last cdc_job run {last[0].run_id} ended {last[0].status.value}")
        now = time.time()
        context.update_cursor(json.dumps({**state, "failures": failures, "launched_at": now}))
        context.log.info(f"launching cdc_job: {reason}")
        return dg.RunRequest(run_key=f"cdc-{int(now * 1000)}", tags={"cdc_platform/reason":
                                                                      reason[:200]})

    return cdc_sensor
