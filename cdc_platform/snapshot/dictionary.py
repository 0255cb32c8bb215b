"""Per-table zstd dictionaries: trained on a sample of the table, published in a KV bucket.

Consumers fetch the dictionary named by a chunk's ``Cdc-Zstd-Dict`` header (also in the meta
message) from KV bucket :data:`DICTIONARY_BUCKET`, key ``{table}.{dictionary id}`` (wire table
names hold only ``[A-Za-z0-9_=/]``, all legal in KV keys), and decompress with it::

    zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(kv_value))

The value is the raw dictionary (``ZDICT`` format, its id inside). Dictionaries are written
once and never changed; a new snapshot trains (and publishes) a new one.

Samples are rows of the table encoded exactly as inside chunks (one row map per sample), so
the dictionary learns the column names, the encoding's framing and typical values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import zstandard
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError

from cdc_platform.consumer.snapshots import DICTIONARY_BUCKET
from cdc_platform.jetstream.kv import put_value
from cdc_platform.jetstream.provision import dictionary_bucket_config
from cdc_platform.wire import Format, MessageSigner, dictionary_key, encoder

log = logging.getLogger(__name__)

DEFAULT_DICTIONARY_BYTES = 64 * 1024
DEFAULT_SAMPLE_ROWS = 20_000
# zstd's trainer wants many samples and much more sample data than dictionary.
_MIN_SAMPLES = 100


@dataclass(frozen=True, slots=True)
class TrainedDictionary:
    dictionary_id: int
    data: bytes
    samples: int
    sample_bytes: int
    # compressed/raw on sample chunks (of ``chunk_rows`` rows), with and without the dictionary
    sample_ratio_with: float
    sample_ratio_without: float


def encode_samples(rows: Sequence[dict], fmt: Format) -> list[bytes]:
    encode = encoder(fmt)
    return [encode(row) for row in rows]


def train(rows: Sequence[dict], fmt: Format, *, level: int,
          dictionary_bytes: int = DEFAULT_DICTIONARY_BYTES,
          chunk_rows: int = 10_000) -> TrainedDictionary | None:
    """A dictionary for ``rows`` (typed row maps), or None when the sample is too small or
    zstd cannot train on it (chunks are then compressed without a dictionary)."""
    samples = encode_samples(rows, fmt)
    total = sum(map(len, samples))
    if len(samples) < _MIN_SAMPLES:
        log.info("zstd dictionary: only %d sample rows, compressing without one", len(samples))
        return None
    size = max(1024, min(dictionary_bytes, total // 10))
    try:
        trained = zstandard.train_dictionary(size, samples, level=level)
    except zstandard.ZstdError as exc:
        log.warning("zstd dictionary training failed (%s): compressing without one", exc)
        return None
    data = trained.as_bytes()
    with_dict, without = sample_ratios(rows, fmt, level=level, dictionary=data,
                                       chunk_rows=chunk_rows)
    return TrainedDictionary(trained.dict_id(), data, len(samples), total, with_dict, without)


def sample_ratios(rows: Sequence[dict], fmt: Format, *, level: int, dictionary: bytes,
                  chunk_rows: int) -> tuple[float, float]:
    """compressed/raw of the sample cut into chunk-sized groups, with and without ``dictionary``."""
    encode = encoder(fmt)
    group = max(1, min(chunk_rows, len(rows)))
    raws = [encode({"data": list(rows[i:i + group])}) for i in range(0, len(rows), group)]
    plain = zstandard.ZstdCompressor(level=level)
    with_dict = zstandard.ZstdCompressor(
        level=level, dict_data=zstandard.ZstdCompressionDict(dictionary))
    raw_total = sum(map(len, raws)) or 1
    return (sum(len(with_dict.compress(r)) for r in raws) / raw_total,
            sum(len(plain.compress(r)) for r in raws) / raw_total)


async def publish_dictionary(js: JetStreamContext, table: str,
                             dictionary: TrainedDictionary, *,
                             bucket: str = DICTIONARY_BUCKET, replicas: int = 1,
                             signer: MessageSigner | None = None) -> str:
    """Store the dictionary in ``bucket`` (``provision`` creates it; created here if
    missing), signed by ``signer`` when there is one; returns its key."""
    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):  # provisioned before the bucket existed
        kv = await js.create_key_value(dictionary_bucket_config(bucket, replicas))
    key = dictionary_key(table, dictionary.dictionary_id)
    await put_value(js, kv, bucket, key, dictionary.data, signer)
    return key


