"""Stop requests (SIGINT, SIGTERM) of the long-running commands, caught from the moment the
command line starts: a signal that arrives while a command still imports, reads its settings
or connects is kept and handed to the command when it starts listening, never lost (nor
ignored because the parent process ignored it). An orchestrator sends SIGTERM whenever it
likes, then SIGKILL."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.received: signal.Signals | None = None  # the first stop signal, once one came
        self._listeners: list[Callable[[], object]] = []

    def install(self) -> None:
        """Catch the stop signals from now on (in the main thread, before anything starts)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        for listener in list(self._listeners):
            listener()

    @contextlib.contextmanager
    def listening(self, listener: Callable[[], object]) -> Iterator[None]:
        """Call ``listener`` at every stop signal while in the block, and at once if one came
        before. It runs in the signal handler: it must only set flags or hand over to a loop
        (``loop.call_soon_threadsafe``)."""
        self._listeners.append(listener)
        try:
            if self.received is not None:
                listener()
            yield
        finally:
            self._listeners.remove(listener)
