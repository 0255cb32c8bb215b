from typing import Any

def decode_chunk(
    data: bytes, columns: tuple[str, ...]
) -> tuple[dict[str, Any], list[tuple[Any, ...]], bool]: ...
