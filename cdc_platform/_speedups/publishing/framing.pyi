from typing import Any

def frame_sequence(
    held: list[Any], reply_prefix: bytes, first_seq: int, reply_suffix: bytes
) -> bytes: ...
