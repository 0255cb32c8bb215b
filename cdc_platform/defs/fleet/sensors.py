"""`mirror_fleet_sensor`: every 30 s, reads KV `mirrors` (as a user that may only read it)
and reports what it finds: an observation of `mirror_fleet` (each mirror's lag, tables, last
verification) and the evaluation of `mirrors_fresh`, as asset events; and, for each verified
table a mirror follows whose verdict changed, a run of `mirrors_equal_source_job` evaluating
that table's `mirrors_equal_source` (only the check selected). A run, not an asset event:
Dagster 1.13 stores a second runless evaluation of one partition of a check against a unique
index (asset, check, run id "", partition) and refuses it. So a mirror that falls behind,
stops or fails a verification turns a check red in the UI without anyone reading logs.

An observation carries every mirror, so it is recorded when what it shows changed (a mirror
came or went, a table's status, a verification, a lag of another power of two) and at least
every OBSERVE_AT_LEAST_SECONDS, not every tick: hundreds of mirrors would otherwise write
hundreds of MB a day into the event log."""

import hashlib
import json
import math
import time

import dagster as dg

from cdc_platform.defs.fleet.assets import (
    LAST_SEEN,
    LAST_STOPPED,
    MIRROR_FLEET,
    MIRRORS_EQUAL_SOURCE,
    MIRRORS_FRESH,
    check_metadata,
    judge_equality,
    judge_freshness,
    read_fleet_now,
    severity,
    unreadable_fleet,
)
from cdc_platform.defs.resources import NatsResource
from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES
from cdc_platform.defs.verification.assets import table_verification
from cdc_platform.fleet import WAITING, Fleet, Judgement

OBSERVE_AT_LEAST_SECONDS = 600.0


def _evaluation(asset_key: dg.AssetKey, check_name: str,
                judgement: Judgement) -> dg.AssetCheckEvaluation:
    return dg.AssetCheckEvaluation(
        asset_key=asset_key, check_name=check_name, passed=judgement.passed,
        severity=severity(judgement), description=judgement.description,
        metadata=check_metadata(judgement))


def _observation(fleet: Fleet, seen: dict[str, float],
                 stopped: dict[str, str]) -> dg.AssetObservation:
    lags = [state.lag_seconds for mirror_id, state in fleet.states.items()
            if mirror_id not in stopped]
    return dg.AssetObservation(asset_key=MIRROR_FLEET, metadata={
        "mirrors": dg.MetadataValue.int(len(fleet.mirror_ids)),
        "max_lag_seconds": dg.MetadataValue.float(max(lags, default=0.0)),
        "fleet": dg.MetadataValue.json({mirror_id: state.summary() for mirror_id, state
                                        in sorted(fleet.states.items())}),
        "unreadable": dg.MetadataValue.json(fleet.unreadable),
        LAST_SEEN: dg.MetadataValue.json(seen),
        # the mirrors that stopped on purpose, listed after their state is gone from KV
        LAST_STOPPED: dg.MetadataValue.json(stopped),
    })


def _lag_band(seconds: float) -> int:
    """Lag as observations tell it apart: 0 under a second, else its power of two."""
    return 0 if seconds < 1 else int(math.log2(seconds)) + 1


def _shown(fleet: Fleet) -> str:
    """A digest of what an observation shows, lags in bands."""
    shown = {mirror_id: [_lag_band(state.lag_seconds), state.summary()["tables"],
                         state.stopped_at]
             for mirror_id, state in fleet.states.items()}
    return hashlib.sha256(json.dumps([shown, fleet.unreadable], sort_keys=True).encode()
                          ).hexdigest()[:16]


def _verdict(judgement: Judgement) -> str:
    """What a new evaluation of mirrors_equal_source is run for when it changes: the
    verification, pass or fail, the mirrors failing it and those resyncing (not each mirror
    meeting it)."""
    failing = {mirror: status for mirror, status in judgement.metadata["mirrors"].items()
               if status not in WAITING}
    return hashlib.sha256(json.dumps(
        [judgement.metadata["verification_id"], judgement.passed, judgement.warning_only,
         failing, judgement.metadata["resyncing"]], sort_keys=True).encode()).hexdigest()[:16]


def _equality_runs(fleet: Fleet, instance: dg.DagsterInstance,
                   verdicts: dict[str, list]) -> tuple[list[dg.RunRequest], dict[str, list]]:
    """A run of mirrors_equal_source for each table whose verdict changed since the last
    tick (``verdicts``, the cursor's: table -> [verdict, when it became the verdict, in ns]),
    and the verdicts now. The run key names the verdict and when it became one: the daemon
    launches a key once, and a verdict the check showed before and shows again (pass, warn,
    pass under one verification) is a new key. Only tables that are partitions: the table
    names in KV were written by readers."""
    followed = {table for state in fleet.states.values() for table in state.tables}
    published = set(instance.get_dynamic_partitions(PUBLISHED_TABLES))
    runs, current = [], {}
    for table in sorted(followed & published):
        judgement = judge_equality(fleet, instance, table)
        if judgement is None:
            continue
        verdict = _verdict(judgement)
        known = verdicts.get(table)
        current[table] = known if known and known[0] == verdict else [verdict, time.time_ns()]
        runs.append(dg.RunRequest(
            run_key=f"{MIRRORS_EQUAL_SOURCE}-{table}-{verdict}-{current[table][1]}",
            partition_key=table, asset_selection=[],
            asset_check_keys=[dg.AssetCheckKey(table_verification.key,
                                               MIRRORS_EQUAL_SOURCE)]))
    return runs, current


def build_mirror_fleet_sensor(equality_job) -> dg.SensorDefinition:
    @dg.sensor(job=equality_job, minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="KV `mirrors` -> observations of `mirror_fleet` and the evaluation "
               "of `mirrors_fresh` every 30 s; a run of `mirrors_equal_source` for a table "
               "whose verdict changed (reads as CDC_FLEET_NATS_*, a user that may only read "
               "the bucket).")
    def mirror_fleet_sensor(context: dg.SensorEvaluationContext,
                            nats: NatsResource) -> dg.SensorResult:
        try:
            fleet = read_fleet_now(nats)
        except Exception as exc:  # noqa: BLE001 - NATS away, no bucket: red, and said
            judgement = unreadable_fleet(exc)
            context.log.warning(judgement.description)
            return dg.SensorResult(asset_events=[_evaluation(MIRROR_FLEET, MIRRORS_FRESH,
                                                             judgement)])
        now = time.time()
        judgement, seen, stopped = judge_freshness(fleet, context.instance, now)
        events: list[dg.AssetObservation | dg.AssetCheckEvaluation] = [
            _evaluation(MIRROR_FLEET, MIRRORS_FRESH, judgement)]
        observed = json.loads(context.cursor) if context.cursor else {}
        shown = _shown(fleet)
        if (shown != observed.get("shown")
                or now - observed.get("at", 0.0) >= OBSERVE_AT_LEAST_SECONDS):
            events.insert(0, _observation(fleet, seen, stopped))
            observed.update(shown=shown, at=now)
        runs, observed["verdicts"] = _equality_runs(fleet, context.instance,
                                                    observed.get("verdicts", {}))
        return dg.SensorResult(run_requests=runs, asset_events=events,
                               cursor=json.dumps(observed))

    return mirror_fleet_sensor
