from collections.abc import Sequence

from cdc_platform.publishing.messages import Held, OutgoingMessage

def frame_messages(
    messages: Sequence[OutgoingMessage], subjects: dict[str, bytes],
    extras: dict[tuple[tuple[str, str], ...], str], max_payload: int,
) -> tuple[list[Held], int, int] | None: ...
