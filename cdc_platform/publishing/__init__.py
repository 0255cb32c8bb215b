"""Getting change events into JetStream: ordered, bounded, acknowledged (see ``jetstream``)."""

from cdc_platform.publishing.jetstream import (
    JetStreamPublisher,
    OutgoingMessage,
    PublishRejected,
    PublishStats,
)

__all__ = ["JetStreamPublisher", "OutgoingMessage", "PublishRejected", "PublishStats"]
