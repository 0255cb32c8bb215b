"""Create or verify the JetStream objects the platform needs, idempotently.

* ``CDC`` stream on ``cdc.>``: change events (retention = how far back a consumer can start
  its cutover; the seed's 1 minute is far too short for that, the default here is 7 days).
* ``INIT`` stream on ``init.>``: snapshot chunks and meta messages.
* ``SNAPSHOT_REQUESTS`` stream on ``snapshot.request.>``: keeps requests until a sensor has
  turned them into runs, so a request made while nothing listens is not lost; with the
  sensor's durable consumer ``cdc_platform_snapshot_requests``, made here so that the sensor
  needs no right to create one. Interest retention: a request the sensor acked is gone, so
  the stream holds pending requests only; when it is full, a new request is refused (discard
  new), never a pending one pushed out, while the per-table limit still drops that table's
  own oldest request (docs/wire-contract.md "Floods").
* ``schemas`` KV bucket: one key per published table.
* ``zstd_dictionaries`` KV bucket: the zstd dictionaries of compressed snapshots (key =
  ``{table}.{dictionary id}``, one version each: an id never names other bytes).
* ``mirrors`` KV bucket: each mirror's state (key = mirror id), written by readers through
  their ``mirror.state.>`` import, gone after its TTL when a mirror stops writing; so its
  stream takes no rollup (a ``Nats-Rollup: all`` header would purge every mirror's state)
  and no per-message TTL header, and READERS gets no mirror of it.

``provision_readers`` makes the other account's side (deploy/nats/nats-server.conf,
docs/operations.md "NATS setup"): mirrors of ``CDC``, ``INIT``, the two KV buckets and the object
store, under the same names, sourced across accounts; readers read those, and a mirror listens on no
subject, so nothing a reader has JetStream deliver anywhere is stored.

An existing object whose config differs is reported field by field and left alone, unless
``update=True`` asks to apply the editable differences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    ExternalStream,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
    StreamSource,
)
from nats.js.errors import APIError, NotFoundError

from cdc_platform.errors import ProvisioningError
from cdc_platform.settings import NatsTopology, StreamLimits

log = logging.getLogger(__name__)

# Fields we own and compare; anything else on an existing stream is the operator's business.
_COMPARED = ("subjects", "retention", "storage", "max_age", "max_bytes", "max_msgs",
             "max_msg_size", "max_msgs_per_subject", "num_replicas", "duplicate_window",
             "discard", "allow_batched")
_IMMUTABLE = ("storage", "retention")
# nats-server moves a stream between these two retentions in place (not to or from work queue)
_RETENTION_UPDATES = {(RetentionPolicy.LIMITS, RetentionPolicy.INTEREST)}

# The snapshot request sensor's durable consumer on SNAPSHOT_REQUESTS: made by provisioning,
# only bound to by the sensor. A tick fetches up to 500 requests; each is acked when it comes
# back after the ack wait to a tick whose cursor is past it, and only then leaves the stream:
# a 10 s wait drained a flood of 6,000 in 58 s (60 s: 206 s), 2,000 unacked being a few
# ticks' worth.
REQUESTS_DURABLE = "cdc_platform_snapshot_requests"
_REQUESTS_ACK_WAIT_SECONDS = 10.0
_REQUESTS_MAX_ACK_PENDING = 2000
_CONSUMER_COMPARED = ("filter_subject", "ack_policy", "ack_wait", "max_ack_pending")
_CONSUMER_EDITABLE = ("ack_wait", "max_ack_pending")


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{label}: {', '.join(names)}" for label, names in
                 (("created", self.created), ("updated", self.updated),
                  ("ok", self.unchanged)) if names]
        return "; ".join(parts) or "nothing to do"


def stream_config(limits: StreamLimits, *, pending_only: bool = False) -> StreamConfig:
    """``pending_only``: a stream of requests that its consumer removes by acking them, which
    refuses new messages when full instead of dropping the oldest (per-subject limits still
    drop a subject's own oldest)."""
    return StreamConfig(
        name=limits.name,
        subjects=list(limits.subjects),
        retention=RetentionPolicy.INTEREST if pending_only else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW if pending_only else DiscardPolicy.OLD,
        max_age=limits.max_age_seconds,
        max_bytes=limits.max_bytes,
        max_msgs=limits.max_msgs,
        max_msg_size=limits.max_message_bytes,
        max_msgs_per_subject=limits.max_msgs_per_subject,
        num_replicas=limits.replicas,
        # JetStream refuses a dedupe window longer than the retention.
        duplicate_window=min(limits.duplicate_window_seconds, limits.max_age_seconds),
        allow_batched=limits.allow_batched or None,
    )


def wanted_streams(topology: NatsTopology) -> list[StreamConfig]:
    return [stream_config(topology.cdc), stream_config(topology.init),
            stream_config(topology.requests, pending_only=True)]


def requests_consumer_config(topology: NatsTopology) -> ConsumerConfig:
    """The snapshot request sensor's durable consumer (see ``REQUESTS_DURABLE``)."""
    subjects = topology.requests.subjects
    return ConsumerConfig(
        name=REQUESTS_DURABLE, durable_name=REQUESTS_DURABLE, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=_REQUESTS_ACK_WAIT_SECONDS, max_ack_pending=_REQUESTS_MAX_ACK_PENDING,
        filter_subject=subjects[0] if len(subjects) == 1 else None)


async def _ensure_requests_consumer(js: JetStreamContext, topology: NatsTopology,
                                    report: ProvisionReport, conflicts: list[str],
                                    update: bool) -> None:
    stream, wanted = topology.requests.name, requests_consumer_config(topology)
    label = f"consumer:{stream}/{REQUESTS_DURABLE}"
    try:
        info = await js.consumer_info(stream, REQUESTS_DURABLE)
    except NotFoundError:
        await js.add_consumer(stream, wanted)
        report.created.append(label)
        return
    differences = {name: (getattr(info.config, name), getattr(wanted, name))
                   for name in _CONSUMER_COMPARED
                   if _normalized(getattr(info.config, name)) != _normalized(
                       getattr(wanted, name))}
    if not differences:
        report.unchanged.append(label)
    elif update and set(differences) <= set(_CONSUMER_EDITABLE):
        await js.add_consumer(stream, wanted)  # same durable: nats-server updates it
        report.updated.append(f"{label} ({', '.join(differences)})")
    else:
        conflicts.append(_describe(label, differences))


def wanted_buckets(topology: NatsTopology) -> list[KeyValueConfig]:
    """The platform's KV buckets: ``schemas``, the dictionaries, the mirrors' states (last:
    see :func:`mirror_state_bucket_config`)."""
    return [
        KeyValueConfig(bucket=topology.schemas.bucket, history=topology.schemas.history,
                       storage=StorageType.FILE, replicas=topology.schemas.replicas,
                       description="cdc_platform table schemas (key = table)"),
        dictionary_bucket_config(topology.dictionaries.bucket, topology.dictionaries.replicas),
        mirror_state_bucket_config(topology),
    ]


def mirror_state_bucket_config(topology: NatsTopology) -> KeyValueConfig:
    limits = topology.mirrors
    return KeyValueConfig(
        bucket=limits.bucket, history=1, ttl=limits.max_age_seconds,
        max_value_size=limits.max_value_bytes, max_bytes=limits.max_bytes,
        storage=StorageType.FILE, replicas=limits.replicas,
        description="cdc_platform mirrors' states (key = mirror id; written by readers "
                    "on mirror.state.{mirror id})")


def reader_written_bucket_stream(wanted: KeyValueConfig) -> StreamConfig:
    """The stream of a KV bucket that readers write (``mirrors``): what nats-py's
    ``create_key_value`` makes, without the rollup and per-message TTL headers a writer could
    use against other keys or the bucket's TTL."""
    return StreamConfig(
        name=f"KV_{wanted.bucket}", description=wanted.description,
        subjects=[f"$KV.{wanted.bucket}.>"], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, discard=DiscardPolicy.NEW, allow_direct=True,
        allow_rollup_hdrs=False, allow_msg_ttl=False, deny_delete=True,
        duplicate_window=min(120.0, wanted.ttl or 120.0), max_age=wanted.ttl,
        max_bytes=wanted.max_bytes, max_msg_size=wanted.max_value_size, max_msgs=-1,
        max_msgs_per_subject=wanted.history, num_replicas=wanted.replicas)


def dictionary_bucket_config(bucket: str, replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=bucket, history=1, storage=StorageType.FILE, replicas=replicas,
        description="cdc_platform zstd dictionaries of INIT snapshots "
                    "(key = {table}.{dictionary id})")


async def _ensure_bucket(js: JetStreamContext, wanted: KeyValueConfig, report: ProvisionReport,
                         conflicts: list[str], *, readers_write: bool = False) -> None:
    try:
        info = await js.stream_info(f"KV_{wanted.bucket}")
    except NotFoundError:
        if readers_write:
            await js.add_stream(reader_written_bucket_stream(wanted))
        else:
            await js.create_key_value(wanted)
        report.created.append(f"kv:{wanted.bucket}")
        return
    differences: dict[str, tuple[Any, Any]] = {}
    if info.config.max_msgs_per_subject != wanted.history:
        differences["history"] = (info.config.max_msgs_per_subject, wanted.history)
    if info.config.storage != StorageType.FILE:
        differences["storage"] = (info.config.storage, StorageType.FILE)
    if (info.config.num_replicas or 1) != wanted.replicas:
        differences["replicas"] = (info.config.num_replicas, wanted.replicas)
    for name, have, want in (("ttl", info.config.max_age, wanted.ttl),
                             ("max_value_size", info.config.max_msg_size,
                              wanted.max_value_size),
                             ("max_bytes", info.config.max_bytes, wanted.max_bytes)):
        unset = 0.0 if name == "ttl" else -1  # (the server's "no limit")
        if _normalized(have or unset) != _normalized(want or unset):
            differences[name] = (have, want)
    if readers_write and info.config.allow_rollup_hdrs:
        differences["allow_rollup_hdrs"] = (True, False)
    if differences:
        conflicts.append(_describe(f"kv:{wanted.bucket}", differences))
    else:
        report.unchanged.append(f"kv:{wanted.bucket}")


async def _ensure_object_store(js: JetStreamContext, topology: NatsTopology,
                               report: ProvisionReport, conflicts: list[str],
                               update: bool) -> None:
    wanted = object_store_config(topology.large.bucket, topology.cdc.max_age_seconds,
                                 topology.large.replicas)
    try:
        info = await js.stream_info(f"OBJ_{wanted.bucket}")
    except NotFoundError:
        await js.create_object_store(wanted.bucket or "", config=wanted)
        report.created.append(f"obj:{wanted.bucket}")
        return
    differences = {}
    if _normalized(info.config.max_age or 0.0) != _normalized(wanted.ttl or 0.0):
        differences["ttl"] = (info.config.max_age, wanted.ttl)
    if (info.config.num_replicas or 1) != wanted.replicas:
        differences["replicas"] = (info.config.num_replicas, wanted.replicas)
    if not differences:
        report.unchanged.append(f"obj:{wanted.bucket}")
    elif update and set(differences) == {"ttl"}:  # follows the CDC stream's max age
        info.config.max_age = wanted.ttl
        await js.update_stream(info.config)
        report.updated.append(f"obj:{wanted.bucket} (ttl)")
    else:
        conflicts.append(_describe(f"obj:{wanted.bucket}", differences))


def _normalized(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return sorted(value)
    return value


def config_differences(existing: StreamConfig, wanted: StreamConfig) -> dict[str, tuple]:
    """``{field: (existing, wanted)}`` for every compared field that differs."""
    differences = {}
    for name in _COMPARED:
        have, want = getattr(existing, name), getattr(wanted, name)
        if name == "duplicate_window" and not have:
            have = 120.0  # server default when unset
        if name == "allow_batched":
            have, want = bool(have), bool(want)
        if name in ("max_msg_size", "max_msgs_per_subject") and have in (None, 0):
            have = -1  # unset on the server: no limit
        if _normalized(have) != _normalized(want):
            differences[name] = (have, want)
    return differences


_INSUFFICIENT_RESOURCES = 10047  # JSInsufficientResourcesErr


_SERVER_LIMIT = "max_file_store; by default 75% of the disk free when it started"
# a READERS mirror is also held to its account's limit (deploy/nats/nats-server.conf)
_READERS_LIMIT = (f"the READERS account's jetstream max_file in the server's config, or its "
                  f"{_SERVER_LIMIT}")


def _no_room(name: str, wanted: StreamConfig, limit: str = _SERVER_LIMIT) -> str:
    return (f"nats-server cannot reserve stream {name}'s max_bytes "
            f"({(wanted.max_bytes or 0) / 1024**3:.1f} GiB) in its JetStream storage: its "
            f"limit ({limit}), less what other streams reserve, is smaller. Raise that limit "
            f"(and the disk), or lower CDC_STREAM_MAX_BYTES / CDC_INIT_MAX_BYTES / "
            f"CDC_REQUESTS_MAX_BYTES")


def object_store_config(bucket: str, max_age_seconds: float, replicas: int = 1
                        ) -> ObjectStoreConfig:
    """The bucket lives as long as the CDC events that reference its objects."""
    return ObjectStoreConfig(
        bucket=bucket, storage=StorageType.FILE, replicas=replicas, ttl=max_age_seconds,
        description="cdc_platform: payloads over max_payload (claim checks of CDC events "
                    "and snapshot chunks; object = message id)")


async def _existing_or_created(js: JetStreamContext, wanted: StreamConfig,
                               storage_limit: str) -> StreamInfo | None:
    """The stream ``wanted`` names as it exists, or None when it was missing and is created
    now (refused for room: an error naming ``storage_limit``)."""
    name = wanted.name or ""
    try:
        return await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(wanted)
        except APIError as exc:
            if exc.err_code == _INSUFFICIENT_RESOURCES:
                raise ProvisioningError(_no_room(name, wanted, storage_limit)) from exc
            raise
        return None


async def _update_stream(js: JetStreamContext, info: StreamInfo,
                         differences: dict[str, tuple]) -> None:
    """Apply ``differences`` (``{field: (existing, wanted)}``) to the stream ``info`` shows."""
    for field_name, (_, want) in differences.items():
        setattr(info.config, field_name, want)
    await js.update_stream(info.config)


def _editable(differences: dict[str, tuple]) -> bool:
    """Whether nats-server can apply ``differences`` to an existing stream."""
    fixed = set(differences) & set(_IMMUTABLE)
    if "retention" in fixed and differences["retention"] in _RETENTION_UPDATES:
        fixed.discard("retention")
    return not fixed


def _describe(stream: str, differences: dict[str, tuple]) -> str:
    return "; ".join(f"{stream}.{name}: existing {have!r}, wanted {want!r}"
                     for name, (have, want) in differences.items())


async def provision(js: JetStreamContext, topology: NatsTopology, *,
                    update: bool = False) -> ProvisionReport:
    """Create what is missing, verify what exists; see the module docstring."""
    report = ProvisionReport()
    conflicts: list[str] = []
    for wanted in wanted_streams(topology):
        name = wanted.name or ""  # (every wanted stream is named)
        info = await _existing_or_created(js, wanted, _SERVER_LIMIT)
        if info is None:
            report.created.append(name)
        if name == topology.requests.name:
            # before updating the stream: one moved to interest retention while no consumer
            # is interested lets its pending requests go
            await _ensure_requests_consumer(js, topology, report, conflicts, update)
        if info is None:
            continue
        differences = config_differences(info.config, wanted)
        if not differences:
            report.unchanged.append(name)
        elif update and _editable(differences):
            await _update_stream(js, info, differences)
            report.updated.append(f"{name} ({', '.join(differences)})")
        else:
            conflicts.append(_describe(name, differences))

    for wanted_bucket in wanted_buckets(topology):
        await _ensure_bucket(js, wanted_bucket, report, conflicts,
                             readers_write=wanted_bucket.bucket == topology.mirrors.bucket)
    await _ensure_object_store(js, topology, report, conflicts, update)

    if conflicts:
        raise ProvisioningError(
            "existing JetStream config differs (re-run with --update to apply editable "
            "changes, or change the settings): " + " | ".join(conflicts)
        )
    log.info("NATS provisioned: %s", report.summary())
    return report


# Where READERS reaches PLATFORM (deploy/nats/nats-server.conf): the consumer-create API it
# imports, under this prefix, and the deliver subjects PLATFORM exports to it.
READERS_API_PREFIX = "$PLATFORM.API"
READERS_DELIVER_PREFIX = "deliver.PLATFORM"
# What a mirror keeps of its origin's config (a mirror has no subjects of its own).
_MIRROR_COMPARED = ("mirror", "storage", "max_age", "max_bytes", "max_msgs",
                    "max_msgs_per_subject", "num_replicas")


def mirror_config(origin: str, limits: StreamConfig, *, api_prefix: str = READERS_API_PREFIX,
                  deliver_prefix: str = READERS_DELIVER_PREFIX) -> StreamConfig:
    """A mirror of PLATFORM's stream ``origin`` under its name, kept as long as the origin
    keeps messages (``limits``: the origin's config). A mirror keeps the origin's stream
    sequences and headers, so a snapshot meta's ``cdc_start_seq`` holds in both."""
    return StreamConfig(
        name=origin,
        mirror=StreamSource(name=origin, external=ExternalStream(
            api=api_prefix, deliver=f"{deliver_prefix}.{origin}")),
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
        max_age=limits.max_age or 0.0, max_bytes=limits.max_bytes or -1,
        max_msgs=limits.max_msgs or -1, max_msgs_per_subject=limits.max_msgs_per_subject or -1,
        num_replicas=limits.num_replicas or 1)


def wanted_mirrors(topology: NatsTopology) -> list[StreamConfig]:
    """The READERS mirrors: ``CDC``, ``INIT``, ``KV_{schemas}``, ``KV_{dictionaries}``,
    ``OBJ_{large}``, with their origins' limits (a KV mirror keeps its history). Not the
    mirrors' states: readers write them and never read them."""

    schemas, dictionaries, _ = wanted_buckets(topology)
    large = object_store_config(topology.large.bucket, topology.cdc.max_age_seconds,
                                topology.large.replicas)
    origins = [
        stream_config(topology.cdc), stream_config(topology.init),
        StreamConfig(name=f"KV_{schemas.bucket}", max_msgs_per_subject=schemas.history,
                     num_replicas=schemas.replicas),
        StreamConfig(name=f"KV_{dictionaries.bucket}",
                     max_msgs_per_subject=dictionaries.history,
                     num_replicas=dictionaries.replicas),
        StreamConfig(name=f"OBJ_{large.bucket}", max_age=large.ttl,
                     num_replicas=large.replicas),
    ]
    return [mirror_config(origin.name or "", origin) for origin in origins]


def _mirror_differences(existing: StreamConfig, wanted: StreamConfig) -> dict[str, tuple]:
    differences = {}
    for name in _MIRROR_COMPARED:
        have, want = getattr(existing, name), getattr(wanted, name)
        if name == "mirror":
            have, want = (None if have is None else (have.name, have.external)), (
                want.name, want.external)
        elif name in ("max_bytes", "max_msgs", "max_msgs_per_subject") and have in (None, 0):
            have = -1
        if _normalized(have) != _normalized(want):
            differences[name] = (have, want)
    return differences


async def provision_readers(js: JetStreamContext, topology: NatsTopology, *,
                            update: bool = False) -> ProvisionReport:
    """Create the READERS mirrors that are missing, verify those that exist (connected as
    READERS' admin user); like :func:`provision`, a difference is reported, and applied
    with ``update`` where a mirror may change (not its origin, nor its storage)."""
    report = ProvisionReport()
    conflicts: list[str] = []
    for wanted in wanted_mirrors(topology):
        name = wanted.name or ""
        info = await _existing_or_created(js, wanted, _READERS_LIMIT)
        if info is None:
            report.created.append(f"mirror:{name}")
            continue
        differences = _mirror_differences(info.config, wanted)
        if not differences:
            report.unchanged.append(f"mirror:{name}")
        elif update and not set(differences) & {"mirror", "storage"}:
            await _update_stream(js, info, differences)
            report.updated.append(f"mirror:{name} ({', '.join(differences)})")
        else:
            conflicts.append(_describe(f"mirror:{name}", differences))
    if conflicts:
        raise ProvisioningError(
            "existing READERS mirror config differs (re-run with --update to apply editable "
            "changes, or change the settings): " + " | ".join(conflicts))
    log.info("NATS READERS provisioned: %s", report.summary())
    return report
