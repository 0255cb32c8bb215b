"""``cdc_sensor``: keeps exactly one cdc_job run alive, relaunching after failures with backoff."""

import json
import time

import dagster as dg

ALIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
         dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
         dg.DagsterRunStatus.CANCELING]
MAX_BACKOFF_SECONDS = 600.0


def build_cdc_sensor(cdc_job: dg.JobDefinition, backoff_seconds: float) -> dg.SensorDefinition:
    @dg.sensor(job=cdc_job, minimum_interval_seconds=15,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Keeps one cdc_job run alive; relaunches after a failure with "
               "exponential backoff; the tick says why it did or did not launch.")
    def cdc_sensor(context: dg.SensorEvaluationContext):
        alive = context.instance.get_runs(
            dg.RunsFilter(job_name=cdc_job.name, statuses=ALIVE), limit=1)
        if alive:
            return dg.SkipReason(f"cdc_job run {alive[0].run_id} is {alive[0].status.value}")
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
