#!/usr/bin/env python
"""The mirror's apply path alone, replayed from messages kept by ``benchmarks/mirror.py
--save-replay DIR``: no NATS, no PostgreSQL, the same work per message as the follower does
(decode, check, whole transactions, SQLite), committed every ``fetch_batch`` messages as the
follower commits after each batch read.

    .venv/bin/python benchmarks/mirror.py --save-replay /tmp/replay   # once
    .venv/bin/python benchmarks/mirror_replay.py /tmp/replay [--messages 40000]

Prints CPU µs per event, against a baseline measured in the same run: decoding the same
payloads with ``msgpack.unpackb`` and nothing else.

``--no-digests-too`` replays them first by a mirror keeping no digests, then as usual, and
prints the digests' upkeep (CPU and, under callgrind, instructions) in the same run; under
callgrind SHA-256 runs its portable code (valgrind has no SHA extensions), ~4K instructions a
64-byte block where the SHA-NI path costs ~100-200 cycles.

``--signing`` replays the messages twice: as kept, then signed here with a throwaway key
(the headers a bridge with ``CDC_SIGNING_KEY_SEED`` writes) by a mirror that trusts that key
and so verifies each one first (docs/wire-contract.md "Signatures"); it prints both and the
difference.

This VM's clock swings ~1.5x within a session; instruction counts do not. Under callgrind
the script counts the replay loop alone (``callgrind_control`` switches collection on and off
around it), so two versions of the code compare to the instruction:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no \\
        .venv/bin/python benchmarks/mirror_replay.py /tmp/replay --messages 40000 --callgrind

(``--callgrind`` prints the collected instructions per event; valgrind is a Debian package,
not a dependency.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cdc_platform.jetstream.pull import PulledMessage
from cdc_platform.mirror.follower import Mirror, _Following
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.transactions import TransactionCollector
from cdc_platform.settings import MirrorSettings, PlatformSettings
from cdc_platform.wire import HEADER_SIGNATURE, HEADER_SIGNING_KEY, MessageSigner
from cdc_platform.wire.signing import new_seed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("replay", type=Path, help="a directory mirror.py --save-replay wrote")
    parser.add_argument("--messages", type=int, default=0,
                        help="replay only the first N messages (0: all), cut at a whole "
                             "transaction")
    parser.add_argument("--callgrind", action="store_true",
                        help="count the loop's instructions (run under valgrind, see above)")
    parser.add_argument("--signing", action="store_true",
                        help="also replay them signed, verified by a mirror trusting the key")
    parser.add_argument("--no-digests-too", action="store_true",
                        help="also replay them by a mirror keeping no digests (first): the "
                             "digests' upkeep in the same run")
    args = parser.parse_args()
    with (args.replay / "messages.pickle").open("rb") as kept:
        saved = pickle.load(kept)
    table, batch = saved["table"], saved["fetch_batch"]
    messages = [PulledMessage(*message) for message in saved["messages"]]
    if args.messages:
        cut = args.messages
        while cut < len(messages) and b"tx_tables" not in messages[cut - 1].data:
            cut += 1  # (a transaction's last event carries tx_tables)
        messages = messages[:cut]

    signer = MessageSigner(new_seed(os.urandom(32))) if args.signing else None
    signed = [_signed(message, signer) for message in messages] if signer else []
    gc.collect()
    gc.freeze()  # (the messages above are not the mirror's to collect)
    if args.no_digests_too:
        bare_events, bare_cpu, _, bare_instructions = _replay(
            args.replay, table, batch, messages, None, args.callgrind, digests=False)
    events, cpu, wall, instructions = _replay(args.replay, table, batch, messages, None,
                                              args.callgrind)
    started = time.process_time()
    for message in messages:
        msgpack.unpackb(message.data, raw=False, strict_map_key=False)
    baseline = time.process_time() - started
    print(f"replay: {events:,} events applied, {cpu / events * 1e6:.2f} µs CPU an event "
          f"(wall {wall / events * 1e6:.2f}); baseline msgpack.unpackb of the same "
          f"payloads {baseline / len(messages) * 1e6:.2f} µs a message, ratio "
          f"{cpu / events / (baseline / len(messages)):.1f}")
    if instructions is not None:
        print(f"callgrind: {instructions / events:,.0f} instructions an event")
    if args.no_digests_too:
        bare = bare_cpu / bare_events
        print(f"without digests: {bare * 1e6:.2f} µs CPU an event; the digests' upkeep "
              f"{(cpu / events - bare) * 1e6:.2f} µs an event, "
              f"{100 * (cpu / events / bare - 1):.1f} % more")
        if instructions is not None and bare_instructions is not None:
            bare = bare_instructions / bare_events
            print(f"callgrind without digests: {bare:,.0f} instructions an event; with "
                  f"{100 * (instructions / events / bare - 1):.1f} % more")
    if signer is not None:
        verified, signed_cpu, signed_wall, _ = _replay(args.replay, table, batch, signed,
                                                       signer.public_key, False)
        print(f"signed and verified: {verified:,} events applied, "
              f"{signed_cpu / verified * 1e6:.2f} µs CPU an event (wall "
              f"{signed_wall / verified * 1e6:.2f}); verifying costs "
              f"{(signed_cpu - cpu) / len(messages) * 1e6:.2f} µs a message "
              f"({len(messages) / verified:.3f} messages an event), apply rate x"
              f"{cpu / signed_cpu:.2f}")


def _replay(replay: Path, table: str, batch: int, messages: list[PulledMessage],
            trusted_key: str | None, callgrind: bool, *, digests: bool = True
            ) -> tuple[int, float, float, int | None]:
    """Apply ``messages`` to a copy of the replay's database as the follower does (verified
    first with ``trusted_key``; keeping the tables' digests or not) -> (events, CPU seconds,
    wall seconds, instructions)."""
    work = Path(tempfile.mkdtemp(prefix="cdc-mirror-replay-"))
    try:
        shutil.copy(replay / "mirror.db", work / "mirror.db")
        options = MirrorSettings(trusted_keys=trusted_key or "")
        mirror = Mirror(PlatformSettings(), [table], work / "mirror.db", options=options,
                        report=lambda line: None)
        store = MirrorStore(work / "mirror.db", digests=digests)
        follow = _Following(mirror, None, store, TransactionCollector([table], keep_events=False),
                            [table])
        verify = mirror.verifier is not None
        loop = asyncio.new_event_loop()  # (the follower verifies a batch read at a time)
        _collect(callgrind, "on")
        started, wall_started = time.process_time(), time.perf_counter()
        for first in range(0, len(messages), batch):
            read = messages[first:first + batch]
            for message in loop.run_until_complete(follow.authentic(read)) if verify else read:
                follow.payload(message, message.data)
            follow.commit()
        cpu, wall = time.process_time() - started, time.perf_counter() - wall_started
        instructions = _collect(callgrind, "off")
        loop.close()
        store.close()
        if mirror.applied_events == 0 or mirror.refused_messages:
            raise SystemExit("nothing was applied, or messages were refused: is this "
                             "replay's database the one its messages follow?")
        return mirror.applied_events, cpu, wall, instructions
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _signed(message: PulledMessage, signer: MessageSigner) -> PulledMessage:
    """``message`` with the signature headers a signing bridge writes."""
    headers = message.headers
    signature = signer.signature(message.subject, headers["Nats-Msg-Id"], headers,
                                 message.data)
    raw = (message.raw_headers or b"NATS/1.0\r\n\r\n")[:-2] + (
        f"{HEADER_SIGNATURE}: {signature}\r\n{HEADER_SIGNING_KEY}: {signer.public_key}\r\n"
        "\r\n").encode()
    return PulledMessage(message.subject, message.stream_seq, message.data, raw,
                         message.raw_reply)


def _collect(enabled: bool, switch: str) -> int | None:
    """Switch callgrind's collection for this process; before "off", the instructions
    collected so far (callgrind_control's totals, every thread)."""
    if not enabled:
        return None
    collected = None
    if switch == "off":
        totals = subprocess.run(["callgrind_control", "-e", str(os.getpid())], check=True,
                                capture_output=True, text=True).stdout  # "Th 1  18,862,835"
        collected = sum(int(count.replace(",", ""))
                        for count in re.findall(r"Th \d+\s+([\d,]+)", totals))
    subprocess.run(["callgrind_control", "-i", switch, str(os.getpid())], check=True,
                   capture_output=True)
    return collected


if __name__ == "__main__":
    main()
