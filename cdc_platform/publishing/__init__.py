"""Getting change events into JetStream: ordered, bounded, acknowledged (see ``publisher``).

``messages`` (what goes in and what comes out), ``framing`` (protocol bytes and replies),
``ledger`` (what is held until stored), ``channels`` (fast-ingest batches or one PubAck per
message), ``publisher`` (the one task that sends, in order)."""

from cdc_platform.publishing.messages import OutgoingMessage, PublishRejected, PublishStats
from cdc_platform.publishing.publisher import JetStreamPublisher

__all__ = ["JetStreamPublisher", "OutgoingMessage", "PublishRejected", "PublishStats"]
