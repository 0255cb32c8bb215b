from typing import Any

def chunk_tuples(
    data: bytes, columns: tuple[str, ...]
) -> tuple[dict[str, Any], list[tuple[Any, ...]], bool]: ...
