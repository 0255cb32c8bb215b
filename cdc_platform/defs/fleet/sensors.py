"""`mirror_fleet_sensor`: every 30 s, reads KV `mirrors` (as a user that may only read it)
and reports what it finds as asset events, no runs: an observation of `mirror_fleet` (each
mirror's lag, tables, last verification) and the evaluation of `mirrors_fresh`. So a mirror
that falls behind or stops turns the check red in the UI without anyone reading logs."""

import time

import dagster as dg

from cdc_platform.defs.fleet.assets import (
    LAST_SEEN,
    MIRROR_FLEET,
    MIRRORS_FRESH,
    check_metadata,
    judge_freshness,
    read_fleet_now,
    severity,
    unreadable_fleet,
)
from cdc_platform.defs.resources import NatsResource
from cdc_platform.fleet import Fleet, Judgement


def _evaluation(asset_key: dg.AssetKey, check_name: str, judgement: Judgement,
                partition: str | None = None) -> dg.AssetCheckEvaluation:
    return dg.AssetCheckEvaluation(
        asset_key=asset_key, check_name=check_name, passed=judgement.passed,
        severity=severity(judgement), description=judgement.description,
        metadata=check_metadata(judgement), partition=partition)


def _observation(fleet: Fleet, seen: dict[str, float]) -> dg.AssetObservation:
    lags = [state.lag_seconds for state in fleet.states.values()]
    return dg.AssetObservation(asset_key=MIRROR_FLEET, metadata={
        "mirrors": dg.MetadataValue.int(len(fleet.mirror_ids)),
        "max_lag_seconds": dg.MetadataValue.float(max(lags, default=0.0)),
        "fleet": dg.MetadataValue.json({mirror_id: state.summary() for mirror_id, state
                                        in sorted(fleet.states.items())}),
        "unreadable": dg.MetadataValue.json(fleet.unreadable),
        LAST_SEEN: dg.MetadataValue.json(seen),
    })


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="KV `mirrors` -> observations of `mirror_fleet` and the evaluation of "
           "its check `mirrors_fresh` (reads as CDC_FLEET_NATS_*, a user that may only read "
           "the bucket); launches no runs.")
def mirror_fleet_sensor(context: dg.SensorEvaluationContext,
                        nats: NatsResource) -> dg.SensorResult:
    try:
        fleet = read_fleet_now(nats)
    except Exception as exc:  # noqa: BLE001 - NATS away, no bucket: red, and said
        judgement = unreadable_fleet(exc)
        context.log.warning(judgement.description)
        return dg.SensorResult(asset_events=[_evaluation(MIRROR_FLEET, MIRRORS_FRESH,
                                                         judgement)])
    judgement, seen = judge_freshness(fleet, context.instance, time.time())
    return dg.SensorResult(asset_events=[
        _observation(fleet, seen), _evaluation(MIRROR_FLEET, MIRRORS_FRESH, judgement)])
