"""The CDC bridge in a thread and event loop of its own, for a host whose own thread must
stay free: a Dagster op, whose thread a cancelled run interrupts
(``DagsterExecutionInterruptedError``). The host turns that into :meth:`BridgeThread.stop`, a
graceful stop (drain, final acknowledgement, disconnect), and reads the bridge's periodic
observations from :meth:`BridgeThread.observed`. No Dagster here."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.settings import PlatformSettings


class BridgeThread:
    def __init__(self, settings: PlatformSettings, *, observe_interval: float) -> None:
        self.settings = settings
        self.observe_interval = observe_interval
        self._observations: queue.Queue[dict[str, Any]] = queue.Queue()
        self._bridge: CdcBridge | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._ready = threading.Event()  # the bridge exists (or could not be made)
        self._thread = threading.Thread(target=self._serve, name="cdc-bridge", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def observed(self) -> list[dict[str, Any]]:
        """The observations made since the last call (figures for the CDC stream asset)."""
        figures = []
        while True:
            try:
                figures.append(self._observations.get_nowait())
            except queue.Empty:
                return figures

    def stop(self, timeout: float) -> None:
        """Ask the bridge to stop gracefully and wait up to ``timeout`` for it."""
        self._ready.wait(10)
        if self._bridge is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._bridge.request_stop)
        self._thread.join(timeout)

    def raise_failure(self) -> None:
        """Raise what ended the bridge, if it failed."""
        if self._failure is not None:
            raise self._failure

    def _serve(self) -> None:
        async def main() -> None:
            self._bridge = CdcBridge(self.settings, observer=self._observations.put,
                                     observe_interval=self.observe_interval)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await self._bridge.run()

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the host's thread
            self._failure = exc
        finally:
            self._ready.set()
