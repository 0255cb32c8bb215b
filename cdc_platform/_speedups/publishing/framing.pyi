from cdc_platform.publishing.messages import Held

def sequence_bytes(
    held: list[Held], reply_prefix: bytes, first_seq: int, reply_suffix: bytes
) -> bytes: ...
