"""The dev stack's view of Dagster runs: cancel the runs in progress when it stops, and tell
its terminal about failed runs. (Only the dev stack uses this; the platform's own liveness
rules are in ``cdc_platform.defs.cdc``.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

log = logging.getLogger(__name__)

_WAITING = (DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED)
_RUNNING = (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING)
_ENDED = (DagsterRunStatus.CANCELED, DagsterRunStatus.FAILURE, DagsterRunStatus.SUCCESS)


def cancel_runs(instance: DagsterInstance, *, timeout: float) -> list[str]:
    """Terminate every run in progress and wait (``timeout``) until each has ended; a run
    whose worker did not answer in time is marked CANCELED, so that nothing stays STARTED
    in run storage once its processes are gone. Returns the ids of the runs it stopped."""
    runs = instance.get_runs(RunsFilter(statuses=[*_WAITING, *_RUNNING]))
    for run in runs:
        if run.status in _WAITING:
            instance.report_run_canceled(run, message="the dev stack is stopping")
        elif run.status != DagsterRunStatus.CANCELING:
            log.info("cancelling Dagster run %s (%s)", run.run_id, run.job_name)
            try:
                if not instance.run_launcher.terminate(run.run_id):
                    log.warning("run %s: its run worker could not be asked to stop",
                                run.run_id)
            except Exception as exc:  # noqa: BLE001 - the deadline below handles it
                log.warning("run %s: terminate failed: %s", run.run_id, exc)
    deadline = time.monotonic() + timeout
    pending = [run.run_id for run in runs]
    while pending and time.monotonic() < deadline:
        pending = [run_id for run_id in pending
                   if (current := instance.get_run_by_id(run_id)) is not None
                   and current.status not in _ENDED]
        if pending:
            time.sleep(0.5)
    for run_id in pending:
        stuck = instance.get_run_by_id(run_id)
        if stuck is not None and stuck.status not in _ENDED:
            instance.report_run_canceled(
                stuck, message=f"did not stop within {timeout:.0f}s of the dev stack stopping")
    return [run.run_id for run in runs]


def failed_runs(instance: DagsterInstance, *, since_run_ids: set[str],
                limit: int = 20) -> Iterator[tuple[str, str, str]]:
    """(run id, job name, one-line reason) of recent failed runs not in ``since_run_ids``."""
    for record in instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.FAILURE]),
                                           limit=limit):
        run = record.dagster_run
        if run.run_id in since_run_ids:
            continue
        yield run.run_id, run.job_name, failure_reason(instance, run.run_id)


def failure_reason(instance: DagsterInstance, run_id: str) -> str:
    """The last line of the step's error (``OSError: ... port 9090 ...``), else the run's."""
    records = instance.get_records_for_run(
        run_id, of_type={DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE}).records
    for record in reversed(records):
        event = record.event_log_entry.dagster_event
        error = getattr(getattr(event, "event_specific_data", None), "error", None)
        if error is not None and error.message:
            return error.message.strip().splitlines()[-1][:300]
        if event is not None and event.message:
            return event.message.strip().splitlines()[-1][:300]
    return "see the run in the Dagster UI"
