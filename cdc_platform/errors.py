"""One error hierarchy for the platform.

Every error says what happened in one line a person can act on, and chains the
underlying cause with ``raise ... from exc``.
"""


class CdcError(Exception):
    """Base class of every error raised by cdc_platform."""


class ConfigError(CdcError):
    """Settings are missing or invalid; the message names the setting."""


class ProtocolError(CdcError):
    """Bytes from PostgreSQL do not follow the replication / pgoutput protocol."""


class ConversionError(CdcError):
    """A column value could not be converted from its text form."""


class ReplicationError(CdcError):
    """The replication connection or slot failed or is unusable."""


class ReplicationConfigError(ReplicationError):
    """PostgreSQL refused us for a reason retrying cannot fix: wrong password, no such role,
    database or publication, missing privileges. Fatal, with what to do."""


class SlotLostError(ReplicationError):
    """The replication slot is missing or was invalidated (WAL removed)."""


class ProvisioningError(CdcError):
    """NATS streams / KV buckets could not be created, or exist with a conflicting config."""


class NatsUnreachable(CdcError):
    """No NATS server of the configured URL answered (retried with backoff by the bridge)."""


class NatsAuthError(CdcError):
    """NATS refused our credentials: fatal, retrying cannot fix it."""


class PublishError(CdcError):
    """A message could not be stored by JetStream."""


class SnapshotError(CdcError):
    """An INIT snapshot could not be taken."""


class TableLockWaitError(SnapshotError):
    """A snapshot task could not lock its table in time: a lock request that conflicts with
    the snapshot's (DDL, typically ALTER TABLE) waits in front of it; or the snapshot's slot
    waits for a transaction whose DDL waits for the snapshot's lock. The snapshot gives way
    and is taken again (the DDL would otherwise wait for the snapshot, and the snapshot's
    tasks or slot for the DDL)."""


class WatermarkNotCarried(SnapshotError):
    """A watermark (a snapshot's, or a verification's verify marker) was written where no
    slot's stream will carry it into `CDC`: the bridge's slot was dropped, lost or replaced
    by one whose start is past it. Its marker will never come, so the run is taken again
    under a new id (a few times at most) rather than published."""


class SlotMissingError(SnapshotError):
    """The bridge's slot did not exist (or was lost) for as long as a snapshot waits for it:
    a watermark written then would be in no slot's stream, so nothing was published."""


class SnapshotRequestRefused(SnapshotError):
    """A snapshot was requested for a table that is unknown or not published."""


class PayloadTooLarge(SnapshotError):
    """A single row encodes to more bytes than the NATS server's max_payload."""


class VerificationError(CdcError):
    """A source verification (docs/verification.md) could not be made or published."""


class BridgeBehindError(VerificationError):
    """The bridge had not stored every transaction below a digest's lsn in time: the digest
    would precede some of them in the stream, so it is not published."""
