from typing import Any

def frame_messages(
    messages: Any, subjects: dict[str, bytes], extras: dict[Any, str], max_payload: int
) -> tuple[list[Any], int, int] | None: ...
