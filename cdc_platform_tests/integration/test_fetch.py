"""Pull fetches that find nothing, against a real nats-server that answers late."""

from __future__ import annotations

import os
import signal

from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from cdc_platform.dev.servers import LocalNatsServer
from cdc_platform.jetstream.connection import connect_nats, fetch_available
from cdc_platform.settings import NatsSettings


async def test_a_fetch_whose_deadline_passes_in_the_wait_is_empty_not_an_error(tmp_path):
    """The snapshot request sensor failed ~12% of its ticks: when the server's answer comes
    after the deadline, nats-py raises asyncio's TimeoutError instead of its own. A paused
    server makes that happen every time."""
    server = LocalNatsServer(tmp_path / "nats")
    server.start()
    client = await connect_nats(NatsSettings(url=server.url))
    try:
        js = client.jetstream()
        await js.add_stream(StreamConfig(name="REQ", subjects=["req.>"]))
        subscription = await js.pull_subscribe(
            "req.>", durable="reader", stream="REQ",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT))
        assert await fetch_available(subscription, 10, 0.5) == []  # the usual idle fetch
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            assert await fetch_available(subscription, 10, 0.3) == []
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        await js.publish("req.x", b"")
        assert len(await fetch_available(subscription, 10, 2.0)) == 1
    finally:
        await client.close()
        server.stop()
