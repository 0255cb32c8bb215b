"""`mirror_fleet`: the mirrors that report their state to KV `mirrors` (observed by
mirror_fleet_sensor), its check `mirrors_fresh`, and `mirrors_equal_source`, the check of each
`table_verification` partition: did every mirror following the table meet its latest
verification equal (cdc_platform/fleet.py judges)."""

import asyncio
import time

import dagster as dg

from cdc_platform.defs.resources import NatsResource
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.defs.verification.assets import table_verification
from cdc_platform.fleet import (
    Fleet,
    Judgement,
    equality,
    freshness,
    read_fleet,
    seen_since,
    stopped_since,
)
from cdc_platform.settings import NatsTopology, OrchestrationSettings, load_settings

MIRROR_FLEET = dg.AssetKey("mirror_fleet")
MIRRORS_FRESH = "mirrors_fresh"
MIRRORS_EQUAL_SOURCE = "mirrors_equal_source"
# the observation's metadata entry remembering when each mirror was last seen (gone ones
# too, for CDC_MIRROR_GONE_KEEP)
LAST_SEEN = "last_seen"
# ... and which of them stopped on purpose, when (a stopped mirror's state is gone from KV
# after its TTL, and it is not gone but stopped)
LAST_STOPPED = "stopped"

mirror_fleet = dg.AssetSpec(
    MIRROR_FLEET, group_name="verification", kinds={"nats"},
    description="The mirrors (`cdc-platform mirror`) reporting their state to KV `mirrors`: "
    "each observation (mirror_fleet_sensor, every 30 s) carries every mirror's lag, tables "
    "and last verification.")


def read_fleet_now(nats: NatsResource) -> Fleet:
    """KV `mirrors` as it is, read with mirror_fleet_sensor's own credential."""
    bucket = load_settings(NatsTopology).mirrors.bucket

    async def read() -> Fleet:
        async with nats.connect("cdc-platform-fleet", as_fleet=True) as client:
            return await read_fleet(client.jetstream(timeout=10.0), bucket)

    return asyncio.run(read())


def _remembered(instance: dg.DagsterInstance, name: str) -> dict:
    """The metadata entry ``name`` (a JSON object) of the latest observation of
    `mirror_fleet` ({}: none)."""
    records = instance.fetch_observations(MIRROR_FLEET, limit=1).records
    observation = records[0].asset_observation if records else None
    entry = observation.metadata.get(name) if observation else None
    data = getattr(entry, "data", None)
    return data if isinstance(data, dict) else {}


def last_seen(instance: dg.DagsterInstance) -> dict[str, float]:
    """When each mirror was last seen, as the latest observation of `mirror_fleet` says."""
    return {str(k): float(v) for k, v in _remembered(instance, LAST_SEEN).items()}


def judge_freshness(fleet: Fleet, instance: dg.DagsterInstance, now: float
                    ) -> tuple[Judgement, dict[str, float], dict[str, str]]:
    """(mirrors_fresh's judgement, each mirror's last time seen from now on, the mirrors
    stopped on purpose)."""
    settings = load_settings(OrchestrationSettings)
    seen = seen_since(last_seen(instance), fleet, now, settings.mirror_gone_keep_seconds)
    stopped = stopped_since({str(k): str(v) for k, v in
                             _remembered(instance, LAST_STOPPED).items()}, fleet, seen)
    return (freshness(fleet, seen, settings.mirror_lag_critical_seconds, stopped), seen,
            stopped)


def latest_verification_id(instance: dg.DagsterInstance, table: str) -> str | None:
    """The id of the table's latest verification: its latest `table_verification`
    materialization says it (None: never verified)."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=table_verification.key, asset_partitions=[table]), limit=1).records
    materialization = records[0].asset_materialization if records else None
    entry = materialization.metadata.get("verification_id") if materialization else None
    value = getattr(entry, "value", None)
    return value if isinstance(value, str) else None


def judge_equality(fleet: Fleet, instance: dg.DagsterInstance, table: str) -> Judgement | None:
    """mirrors_equal_source's judgement of ``table`` (None: never verified, or no mirror
    follows it)."""
    verification_id = latest_verification_id(instance, table)
    if verification_id is None:
        return None
    return equality(table, verification_id, fleet.states.values())


def unreadable_fleet(exc: Exception) -> Judgement:
    return Judgement(passed=False, description=f"KV mirrors could not be read: "
                     f"{type(exc).__name__}: {str(exc)[:300]}", metadata={})


def check_metadata(judgement: Judgement) -> dict[str, dg.MetadataValue]:
    return {name: dg.MetadataValue.json(value) if isinstance(value, (dict, list))
            else dg.MetadataValue.float(value) if isinstance(value, float)
            else dg.MetadataValue.int(value) if isinstance(value, int)
            else dg.MetadataValue.text(str(value))
            for name, value in judgement.metadata.items()}


def severity(judgement: Judgement) -> dg.AssetCheckSeverity:
    return dg.AssetCheckSeverity.WARN if judgement.warning_only else dg.AssetCheckSeverity.ERROR


@dg.asset_check(asset=MIRROR_FLEET, name=MIRRORS_FRESH,
                description="Fails when a mirror is more than CDC_MIRROR_LAG_CRITICAL (300 s) "
                "behind the source, when a mirror that reported is gone (no state in KV "
                "`mirrors` after its TTL) without having said it stopped, or when a state is "
                "unreadable. A mirror that stopped on purpose (`--once`, SIGTERM) is listed "
                "as `stopped`, and passes. Evaluated by mirror_fleet_sensor every 30 s.")
def mirrors_fresh(context: dg.AssetCheckExecutionContext,
                  nats: NatsResource) -> dg.AssetCheckResult:
    try:
        judgement, _, _ = judge_freshness(read_fleet_now(nats), context.instance,
                                          time.time())
    except Exception as exc:  # noqa: BLE001 - NATS away, no bucket: the check says so
        judgement = unreadable_fleet(exc)
    return dg.AssetCheckResult(passed=judgement.passed, severity=severity(judgement),
                               description=judgement.description,
                               metadata=check_metadata(judgement))


@dg.asset_check(asset=table_verification, name=MIRRORS_EQUAL_SOURCE,
                partitions_def=published_tables_partitions,
                description="Per table: passes when every mirror following it (KV `mirrors`) "
                "met its latest verification `equal` or `repaired`; fails (ERROR) when one "
                "found it `differ` or `not_comparable`, (WARN) while some have not met it yet "
                "or are `resyncing` (not verified since the bridge lost its slot). Metadata: "
                "mirrors, buckets_differing, rows_repaired, not_comparable, pending, "
                "resyncing. "
                "Evaluated by mirror_fleet_sensor as the mirrors report.")
def mirrors_equal_source(context: dg.AssetCheckExecutionContext,
                         nats: NatsResource) -> dg.AssetCheckResult:
    table = context.partition_key
    try:
        judgement = judge_equality(read_fleet_now(nats), context.instance, table) or Judgement(
            passed=True, description=f"{table}: not verified yet, or no mirror follows it",
            metadata={})
    except Exception as exc:  # noqa: BLE001 - NATS away, no bucket: the check says so
        judgement = unreadable_fleet(exc)
    return dg.AssetCheckResult(passed=judgement.passed, severity=severity(judgement),
                               description=judgement.description,
                               metadata=check_metadata(judgement))
