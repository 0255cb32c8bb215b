from collections.abc import Callable

def deliver(
    data: bytes, position: int, sinks: dict[int, Callable[[bytes, bytes, bytes, bytes | None], None]]
) -> int: ...
