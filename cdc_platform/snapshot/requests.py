"""Snapshot requests and their replies (docs/wire-contract.md "Snapshot requests"). No Dagster here:
the sensor and the snapshot asset call these.

A consumer publishes on ``snapshot.request.{table}``; the body is empty or a JSON object:
``request_id`` (str, echoed back), ``reply_to`` (an ``_INBOX.`` subject; replies are
core-NATS publishes there), ``max_age_seconds`` (reuse a snapshot of the table at most this old whose
cutover point the CDC stream still holds; default ``CDC_SNAPSHOT_REUSE_SECONDS``; never less
than ``CDC_SNAPSHOT_MIN_INTERVAL``, see ``Pacing``), ``min_lsn`` (reuse only a snapshot whose cutover LSN is at least this: a consumer
that must bootstrap again after a rewrite asks for one taken after it), ``purpose``
(``snapshot``, the default; ``verify``: a verification digest of the table instead,
docs/verification.md; ``repair``: a snapshot of some buckets only, its meta on
``init.repair.{table}``), ``bits`` and ``buckets`` (verify: optional, the buckets to digest;
repair: required, the buckets to read; a repair may give them as ``bucket_bitmap`` instead,
``wire.bucket_sets``). Replies are JSON objects: ``request_id``, ``table``, ``status`` (``accepted``,
``refused``, ``done``, ``failed``) and per status ``reason`` (refused, failed), ``run_key``
(accepted), ``snapshot_id``, ``lsn``, ``cdc_stream``, ``cdc_start_seq``, ``meta_subject``,
``meta_seq``, ``reused`` (done); a verification's ``done``: ``verification_id``, ``lsn``,
``digest_subject``, ``digest_seq``, ``bits``, ``row_count``. Verifications are never reused
(each is a new digest at a new point). A repair asks for at most a quarter of the table's
buckets (more: refused, "request a full snapshot"); the repair requests of one table in one
pass share one run, of the union of their buckets at the finest bits, whose ``done`` names its
meta on ``init.repair.{table}`` (``meta_subject``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError

from cdc_platform.consumer.snapshots import reusable_snapshot
from cdc_platform.errors import ProvisioningError
from cdc_platform.jetstream.connection import fetch_available
from cdc_platform.lsn import parse_lsn
from cdc_platform.naming import parse_wire_name
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.wire import (
    BUCKET_BITMAP_FIELD,
    REQUEST_BODY_MAX_BYTES,
    SNAPSHOT_REQUEST_PREFIX,
    SignatureVerifier,
    decode_bucket_bitmap,
)

log = logging.getLogger(__name__)

# a run's tag holds at most this many reply subjects (a tag value is kept short); more
# requesters of one table get "accepted" and find the result in init.meta.{table}
MAX_REPLIES_PER_RUN = 20
# Replies go to inbox subjects only: the platform replies with its own credential, and a
# requester naming `$KV.schemas.users`, `init.meta.users` or `cdc.users.insert` as its
# reply_to had it overwrite a schema, plant a meta or write into CDC (a confused deputy).
# `_INBOX.` or a per-user inbox prefix `_INBOX_{name}.` (nats-py's inbox_prefix).
REPLY_PREFIX = "_INBOX."
_REPLY_SUBJECT = re.compile(
    r"_INBOX(_[A-Za-z0-9_-]{1,64})?\.[A-Za-z0-9_$=/-]+(\.[A-Za-z0-9_$=/-]+)*")
_SUBJECT = re.compile(r"[A-Za-z0-9_$=/-]+(\.[A-Za-z0-9_$=/-]+)*")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
PURPOSES = ("snapshot", "verify", "repair")
MAX_REQUEST_BITS = 20  # the finest buckets a request may name (a repair bisecting)
# A repair of more than this share of a table's buckets reads nearly as much as a full
# snapshot, and moves several times what a mirror would bootstrap from instead: refused.
MAX_REPAIR_SHARE = 0.25


@dataclass(frozen=True)
class SnapshotRequest:
    table: str
    seq: int  # stream sequence in SNAPSHOT_REQUESTS
    request_id: str | None = None
    reply_to: str | None = None
    max_age_seconds: float | None = None
    refused: str | None = None  # why, when the request itself is unusable
    min_lsn: int = 0  # reuse only a snapshot whose cutover LSN is at least this
    purpose: str = "snapshot"  # one of PURPOSES
    bits: int | None = None  # verify/repair: the buckets' bits ...
    buckets: tuple[int, ...] | None = None  # ... and which (None: all of them)

    @property
    def requester(self) -> list[str | None] | None:
        """What a run needs to answer this request later (None: nobody to answer)."""
        return [self.request_id, self.reply_to] if self.reply_to else None


def parse_request(subject: str, data: bytes, seq: int) -> SnapshotRequest:
    """A request from its message; ``refused`` says what is wrong with a malformed one (the
    reply fields are kept when they could be read, so the refusal can be answered)."""
    table = subject[len(SNAPSHOT_REQUEST_PREFIX) + 1:]
    try:
        parse_wire_name(table)
    except ValueError:
        return SnapshotRequest(table, seq, refused=f"{table!r} is not a wire table name")
    if not data.strip():
        return SnapshotRequest(table, seq)
    # A body over the limit is still read for its reply fields (the stream stores at most
    # its max_msg_size, 8 KB by default): the refusal names the limit to whoever asked.
    too_large = (f"request body is {len(data):,} bytes, over the "
                 f"{REQUEST_BODY_MAX_BYTES:,}-byte limit"
                 if len(data) > REQUEST_BODY_MAX_BYTES else None)
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return SnapshotRequest(table, seq, refused=too_large or "request body is not JSON")
    if not isinstance(body, dict):
        return SnapshotRequest(table, seq,
                               refused=too_large or "request body is not a JSON object")
    request_id, reply_to = body.get("request_id"), body.get("reply_to")
    request_id = request_id if isinstance(request_id, str) and _REQUEST_ID.fullmatch(
        request_id) else None
    reply_to = reply_to if is_reply_subject(reply_to) else None
    max_age = body.get("max_age_seconds")
    problems = [too_large] if too_large else []
    if body.get("request_id") is not None and request_id is None:
        problems.append("request_id must be 1-128 printable ASCII characters")
    if body.get("reply_to") is not None and reply_to is None:
        problems.append(f"reply_to must be an inbox subject ({REPLY_PREFIX}...) without "
                        "wildcards")
    if max_age is not None and (isinstance(max_age, bool)
                                or not isinstance(max_age, (int, float)) or max_age < 0):
        problems.append("max_age_seconds must be a number >= 0")
        max_age = None
    min_lsn = 0
    if body.get("min_lsn") is not None:
        try:
            min_lsn = parse_lsn(body["min_lsn"])
        except (ValueError, TypeError, AttributeError):
            problems.append("min_lsn must be an LSN such as 16/B374D848")
    purpose, bits, buckets = _purpose(body, problems)
    return SnapshotRequest(table, seq, request_id, reply_to,
                           None if max_age is None else float(max_age),
                           "; ".join(problems) or None, min_lsn, purpose, bits, buckets)


def _purpose(body: Mapping[str, Any], problems: list[str]
             ) -> tuple[str, int | None, tuple[int, ...] | None]:
    """``purpose``, ``bits`` and ``buckets`` of a request body (a repair's ``bucket_bitmap``
    read as its buckets); what is wrong goes to ``problems``."""
    purpose = body.get("purpose", "snapshot")
    if purpose not in PURPOSES:
        problems.append(f"purpose must be one of {', '.join(PURPOSES)}")
        return "snapshot", None, None
    bits, buckets = body.get("bits"), body.get("buckets")
    bitmap = body.get(BUCKET_BITMAP_FIELD)
    if purpose == "snapshot":
        if bits is not None or buckets is not None or bitmap is not None:
            problems.append("bits and buckets are for purpose verify or repair")
        return purpose, None, None
    if bitmap is not None and purpose != "repair":
        problems.append(f"{BUCKET_BITMAP_FIELD} is for purpose repair (verify: buckets)")
        return purpose, None, None
    if bits is None:
        if purpose == "repair" or buckets is not None:
            problems.append(f"purpose {purpose} with buckets needs bits")
        return purpose, None, None
    if isinstance(bits, bool) or not isinstance(bits, int) or not 0 <= bits <= (
            MAX_REQUEST_BITS):
        problems.append(f"bits must be an integer 0..{MAX_REQUEST_BITS}")
        return purpose, None, None
    if bitmap is not None:
        if buckets is not None:
            problems.append(f"purpose repair takes buckets or {BUCKET_BITMAP_FIELD}, not both")
            return purpose, bits, None
        try:
            return purpose, bits, decode_bucket_bitmap(bits, bitmap)
        except ValueError as exc:
            problems.append(str(exc))
            return purpose, bits, None
    if buckets is None:
        if purpose == "repair":
            problems.append(f"purpose repair needs buckets or {BUCKET_BITMAP_FIELD}")
        return purpose, bits, None
    if (not isinstance(buckets, list) or not buckets
            or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 1 << bits
                   for b in buckets)):
        problems.append(f"buckets must be a non-empty list of integers below 2^{bits}")
        return purpose, bits, None
    return purpose, bits, tuple(sorted(set(buckets)))


@dataclass(frozen=True)
class RunInFlight:
    """A snapshot run of one table already queued or running."""

    table: str
    run_key: str
    started: bool  # running: it may have taken its snapshot already

    @property
    def joinable(self) -> bool:
        """Whether a request that arrives now may join this run: only while it waits. A
        run that started may have taken its snapshot (even stored its meta) before the
        request arrived, and a joined requester waits for a meta stored after it asked
        (docs/wire-contract.md "Snapshot requests"): it would wait for good."""
        return not self.started


def summarize(notes: list[str], limit: int = 5) -> list[str]:
    """At most ``limit`` notes and a count of the rest: a flood of requests must not become
    a flood of log lines."""
    if len(notes) <= limit:
        return notes
    return [*notes[:limit], f"... and {len(notes) - limit:,} more like these"]


@dataclass
class Reply:
    status: str
    table: str
    request_id: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> bytes:
        return json.dumps({"request_id": self.request_id, "table": self.table,
                           "status": self.status, **self.fields}).encode()


def is_reply_subject(subject: object) -> bool:
    """Whether a reply may be sent to ``subject``: an inbox subject without wildcards."""
    return isinstance(subject, str) and _REPLY_SUBJECT.fullmatch(subject) is not None


async def send_replies(client: NatsClient, replies: list[tuple[str | None, Reply]]) -> None:
    """Core-NATS publishes; a requester that is gone is not an error. A reply subject that is
    no inbox (a run tag edited in the UI, say) gets nothing."""
    for reply_to, reply in replies:
        if not reply_to:
            continue
        if not is_reply_subject(reply_to):
            log.warning("not replying to %r: replies go to inbox subjects (%s...) only",
                        reply_to, REPLY_PREFIX)
            continue
        await client.publish(reply_to, reply.payload())
    await client.flush()


def done_fields(result: Any) -> dict[str, Any]:
    """The ``done`` reply of a snapshot just taken (a ``SnapshotResult``)."""
    return {"snapshot_id": result.snapshot_id, "lsn": result.lsn,
            "cdc_stream": result.cdc_stream, "cdc_start_seq": result.cdc_start_seq,
            "meta_subject": result.meta_subject, "meta_seq": result.meta_seq, "reused": False}


def request_run_key(table: str, seq: int) -> str:
    """The run key of the snapshot run that a table's request at stream ``seq`` starts."""
    return f"snapshot-request-{table}-{seq}"


def verification_run_key(table: str, seq: int) -> str:
    """The run key of the verification run that a table's request at stream ``seq`` starts."""
    return f"verify-request-{table}-{seq}"


def verification_done_fields(result: Any) -> dict[str, Any]:
    """The ``done`` reply of a verification just made (a ``VerificationResult``)."""
    return {"verification_id": result.verification_id, "lsn": result.lsn,
            "digest_subject": result.digest_subject, "digest_seq": result.digest_seq,
            "bits": result.bits, "row_count": result.row_count}


# what a verification run digests: (table, bits, buckets); requests asking the same share a run
VerificationKey = tuple[str, int | None, tuple[int, ...] | None]


def repair_run_key(table: str, seq: int) -> str:
    """The run key of the repair run that a table's repair request at stream ``seq`` (the
    last of its pass) starts."""
    return f"repair-request-{table}-{seq}"


def repair_request_refusal(request: SnapshotRequest) -> str | None:
    """Why a well-formed ``purpose: repair`` request is not served (None: it is)."""
    if request.bits is None or request.buckets is None:
        return "purpose repair needs bits and buckets"
    share = len(request.buckets) / (1 << request.bits)
    if share > MAX_REPAIR_SHARE:
        return (f"{len(request.buckets)} of {1 << request.bits} buckets is more than a "
                f"quarter of the table: request a full snapshot")
    return None


@dataclass
class HeldRun:
    """A table's snapshot run that requests asked for, held back until ``not_before``: the
    table's previous request-started run began less than the minimum interval ago. Its
    requesters were answered ``accepted`` with its run key, and the run answers them."""

    seq: int  # the stream sequence of its first request (names its run key)
    requesters: list  # [request_id, reply_to] of the requests it serves
    not_before: float  # time.time() from which it may start
    # a verification run's bits and buckets (a snapshot run has neither)
    bits: int | None = None
    buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None:  # (a list when read back from JSON)
            self.buckets = tuple(self.buckets)


@dataclass
class Pacing:
    """The minimum interval between a table's snapshot runs started by requests
    (docs/wire-contract.md "Floods"; 0: none), and between its repair runs.
    ``last_started``: table -> when its newest request-started run was created; ``held``:
    the runs held back (updated in place); ``repairs_started``: table -> when its newest
    repair run was created."""

    min_interval: float = 0.0
    last_started: Mapping[str, float] = field(default_factory=dict)
    held: dict[str, HeldRun] = field(default_factory=dict)
    repairs_started: Mapping[str, float] = field(default_factory=dict)

    def repair_retry_after(self, table: str, now: float) -> float | None:
        """Seconds until a repair run of ``table`` may start (None: now). Each reads the
        whole table: a consumer asking again and again must not keep it scanning."""
        started = self.repairs_started.get(table)
        if started is None or now - started >= self.min_interval:
            return None
        return started + self.min_interval - now

    def hold(self, table: str, seq: int, now: float) -> HeldRun | None:
        """The held run a request of ``table`` that needs a new run joins (None: one may
        start now)."""
        if table in self.held:
            return self.held[table]
        started = self.last_started.get(table)
        if started is None or now - started >= self.min_interval:
            return None
        self.held[table] = HeldRun(seq, [], started + self.min_interval)
        return self.held[table]


@dataclass(frozen=True)
class HandledRequests:
    """What one pass over new requests decided."""

    highest_seq: int  # the highest stream sequence handled
    runs: dict[str, tuple[int, list]]  # table -> (seq of its last request, requesters)
    notes: list[str]  # what was decided, for the log (refusals summarized)
    # the verification runs to start: (table, bits, buckets) -> (seq of its last request,
    # requesters)
    verifications: dict[VerificationKey, tuple[int, list]] = field(default_factory=dict)
    # the repair runs to start: table -> (seq of its last repair request, requesters, the
    # union of their buckets)
    repairs: dict[str, tuple[int, list, BucketSelection]] = field(default_factory=dict)


async def answer_requests(client: NatsClient, requests: list[SnapshotRequest], *,
                          published: Mapping[str, int], publication: str, reuse_seconds: float,
                          in_flight: dict[str, RunInFlight], init_stream: str = "INIT",
                          reply_client: NatsClient | None = None,
                          pacing: Pacing | None = None,
                          verifier: SignatureVerifier | None = None,
                          verifying: Mapping[VerificationKey, RunInFlight] | None = None,
                          verify_pacing: Pacing | None = None) -> HandledRequests:
    """Decide every request (in stream order) and send the replies that are due now, through
    ``reply_client`` (default: ``client``) (``published``: the publication's tables -> their
    oids):
    refusals (malformed, unknown or unpublished table), ``done`` with a recent snapshot of
    the same table (its oid, not only its name; at most ``max_age_seconds`` old, and never
    required younger than ``pacing.min_interval``),
    ``accepted``/``coalesced`` for a table whose run is in flight (``in_flight``),
    ``accepted`` for a run held back by ``pacing`` (it joins ``pacing.held``), and
    ``accepted`` for the runs to start (one per table, named by its last request); the run
    answers those with ``done`` or ``failed``. With ``verifier`` (the platform signs its
    snapshots), a meta it refuses is never handed out. Requests with ``purpose: verify``
    go to :class:`_VerifyRequests` (``verifying``: the verification runs in flight;
    ``verify_pacing``: their own minimum interval and held runs). Requests with ``purpose:
    repair`` of one table share one run (``repairs``), of the union of their buckets at the
    finest bits; one asking for more than a quarter of the buckets is refused, and so are all
    of a table's when together they do, and any while the table's last repair run started
    less than ``pacing.min_interval`` ago (with ``retry_after``)."""
    js = client.jetstream()
    pacing = pacing or Pacing()
    now = time.time()
    runs: dict[str, tuple[int, list]] = {}
    replies: list[tuple[str | None, Reply]] = []
    accepted: list[SnapshotRequest] = []
    notes: list[str] = []
    refusals: list[str] = []
    joined: dict[str, int] = {}
    held_back: dict[str, int] = {}
    verifications = _VerifyRequests(verifying or {}, verify_pacing or Pacing())
    repairs: dict[str, tuple[int, list, list[tuple[int, tuple[int, ...]]]]] = {}
    for request in requests:
        reason = request.refused or (
            None if request.table in published
            else f"{request.table!r} is not a table of publication {publication}") or (
            repair_request_refusal(request) if request.purpose == "repair" else None)
        if reason is not None:
            refusals.append(f"refused snapshot request for {request.table[:200]!r} "
                            f"(stream seq {request.seq}): {reason}")
            replies.append((request.reply_to, Reply("refused", request.table,
                                                    request.request_id,
                                                    {"reason": reason})))
            continue
        if request.purpose == "verify":
            reply = verifications.take(request, now)
            if reply is None:
                accepted.append(request)
            else:
                replies.append((request.reply_to, reply))
            continue
        if request.purpose == "repair":
            assert request.bits is not None and request.buckets is not None  # (refused else)
            wait = pacing.repair_retry_after(request.table, now)
            if wait is not None:
                reason = (f"a repair of {request.table!r} started less than "
                          f"{pacing.min_interval:.0f}s ago: ask again in {wait:.0f}s")
                refusals.append(f"refused repair request for {request.table[:200]!r} "
                                f"(stream seq {request.seq}): {reason}")
                replies.append((request.reply_to, Reply(
                    "refused", request.table, request.request_id,
                    {"reason": reason, "retry_after": round(wait, 1)})))
                continue
            _, requesters, asked = repairs.get(request.table, (0, [], []))
            if request.requester is not None:
                requesters.append(request.requester)
            asked.append((request.bits, request.buckets))
            repairs[request.table] = (request.seq, requesters, asked)
            accepted.append(request)
            continue
        max_age = max(pacing.min_interval, reuse_seconds if request.max_age_seconds is None
                      else request.max_age_seconds)
        reused = await reusable_snapshot(js, request.table, max_age, init_stream,
                                         request.min_lsn,
                                         relation_id=published[request.table],
                                         verifier=verifier)
        if reused is not None:
            notes.append(f"request for {request.table!r} (stream seq {request.seq}) "
                         f"answered with snapshot {reused['snapshot_id']}")
            replies.append((request.reply_to, Reply("done", request.table,
                                                    request.request_id, reused)))
            continue
        running = in_flight.get(request.table)
        if running is not None and running.joinable:
            joined[request.table] = joined.get(request.table, 0) + 1
            replies.append((request.reply_to, Reply(
                "accepted", request.table, request.request_id,
                {"run_key": running.run_key, "coalesced": True})))
            continue
        held = None if request.table in runs else pacing.hold(request.table, request.seq,
                                                                  now)
        if held is not None:
            if request.requester is not None and len(held.requesters) < MAX_REPLIES_PER_RUN:
                held.requesters.append(request.requester)
            replies.append((request.reply_to, Reply("accepted", request.table,
                                                    request.request_id, {
                "run_key": request_run_key(request.table, held.seq)})))
            held_back[request.table] = held_back.get(request.table, 0) + 1
            continue
        _, requesters = runs.get(request.table, (0, []))
        if request.requester is not None:
            requesters.append(request.requester)
        # repeated requests for one table coalesce into one run
        runs[request.table] = (request.seq, requesters)
        accepted.append(request)
    repair_runs = {table: (seq, requesters, BucketSelection.union(asked))
                   for table, (seq, requesters, asked) in repairs.items()}
    for table, (_, _, selection) in list(repair_runs.items()):
        if selection.share > MAX_REPAIR_SHARE:  # each asked for a quarter at most: together
            del repair_runs[table]
            reason = (f"the repairs asked of {table!r} at once add up to "
                      f"{len(selection.buckets)} of {1 << selection.bits} buckets, more "
                      "than a quarter of the table: request a full snapshot")
            refusals.append(f"refused repair requests for {table[:200]!r}: {reason}")
            replies += [(request.reply_to, Reply("refused", table, request.request_id,
                                                 {"reason": reason}))
                        for request in accepted
                        if request.purpose == "repair" and request.table == table]
    accepted = [request for request in accepted
                if request.purpose != "repair" or request.table in repair_runs]
    # the run key names the table's last request: known once all are read
    replies += [(request.reply_to, Reply("accepted", request.table, request.request_id, {
        "run_key": verification_run_key(request.table, verifications.runs[
            request.table, request.bits, request.buckets][0]) if request.purpose == "verify"
        else repair_run_key(request.table, repairs[request.table][0])
        if request.purpose == "repair"
        else request_run_key(request.table, runs[request.table][0])}))
        for request in accepted]
    notes += [f"snapshot run for {table!r} (request seq {seq}, {len(requesters)} "
              "awaiting a reply)" for table, (seq, requesters) in runs.items()]
    notes += verifications.notes()
    notes += [f"repair run for {table!r}: {len(selection.buckets)} of {1 << selection.bits} "
              f"buckets (request seq {seq}, {len(requesters)} awaiting a reply)"
              for table, (seq, requesters, selection) in repair_runs.items()]
    notes += [f"{count} request(s) for {table!r} joined its run already in flight "
              f"({in_flight[table].run_key})" for table, count in joined.items()]
    notes += [f"{count} request(s) for {table!r} joined its run held back until "
              f"{time.strftime('%H:%M:%S', time.gmtime(pacing.held[table].not_before))} UTC "
              f"(its previous request-started run began less than "
              f"{pacing.min_interval:.0f}s before)" for table, count in held_back.items()]
    if refusals:
        notes[:0] = summarize(refusals)
    await send_replies(reply_client or client, replies)
    return HandledRequests(max(r.seq for r in requests), runs, notes, verifications.runs,
                           repair_runs)


def _utc_time(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(timestamp))


class _VerifyRequests:
    """The verify requests of one pass. A request joins a queued verification run of the same
    table, bits and buckets (``verifying``), else this pass's run of them (``runs``), else the
    table's run held back by ``pacing`` when it asks the same (another is refused until that
    one started: a table's verification runs started by requests begin at least
    ``pacing.min_interval`` apart, whatever they ask), else starts a run."""

    def __init__(self, verifying: Mapping[VerificationKey, RunInFlight],
                 pacing: Pacing) -> None:
        self.verifying = verifying
        self.pacing = pacing
        self.runs: dict[VerificationKey, tuple[int, list]] = {}
        self.joined: dict[str, int] = {}  # run key -> requests that joined it
        self.held_back: dict[str, int] = {}  # table -> requests that joined its held run

    def take(self, request: SnapshotRequest, now: float) -> Reply | None:
        """The reply due now (None: ``accepted`` with the run key of ``runs``, known once
        every request is read)."""
        table, key = request.table, (request.table, request.bits, request.buckets)
        running = self.verifying.get(key)
        if running is not None and running.joinable:
            self.joined[running.run_key] = self.joined.get(running.run_key, 0) + 1
            return Reply("accepted", table, request.request_id,
                         {"run_key": running.run_key, "coalesced": True})
        if key not in self.runs:
            held = self._held(request, now)
            if held is not None:
                return self._join_held(held, request)
            self.runs[key] = (request.seq, [])
        _, requesters = self.runs[key]
        if request.requester is not None:
            requesters.append(request.requester)
        self.runs[key] = (request.seq, requesters)  # the run key names the last request
        return None

    def _held(self, request: SnapshotRequest, now: float) -> HeldRun | None:
        """The table's held run this request meets (None: a run may start now)."""
        pacing, table = self.pacing, request.table
        if table in pacing.held or not pacing.min_interval:
            return pacing.held.get(table)
        if any(other == table for other, _, _ in self.runs):  # one starts in this pass
            pacing.held[table] = HeldRun(request.seq, [], now + pacing.min_interval)
        elif pacing.hold(table, request.seq, now) is None:
            return None
        held = pacing.held[table]
        held.bits, held.buckets = request.bits, request.buckets
        return held

    def _join_held(self, held: HeldRun, request: SnapshotRequest) -> Reply:
        table = request.table
        if (held.bits, held.buckets) != (request.bits, request.buckets):
            return Reply("refused", table, request.request_id, {"reason": (
                f"a verification of {table!r} with other bits or buckets is held back until "
                f"{_utc_time(held.not_before)} UTC (at most one a table every {self.pacing.min_interval:.0f}s): "
                "ask again after it started")})
        if request.requester is not None and len(held.requesters) < MAX_REPLIES_PER_RUN:
            held.requesters.append(request.requester)
        self.held_back[table] = self.held_back.get(table, 0) + 1
        return Reply("accepted", table, request.request_id,
                     {"run_key": verification_run_key(table, held.seq)})

    def notes(self) -> list[str]:
        """What the pass decided of verifications, for the log."""
        started = [
            f"verification run for {table!r}{'' if bits is None else f' at {bits} bits'}"
            f"{'' if buckets is None else f' ({len(buckets)} buckets)'} (request seq {seq}, "
            f"{len(requesters)} awaiting a reply)"
            for (table, bits, buckets), (seq, requesters) in self.runs.items()]
        joined = [f"{count} verify request(s) joined verification run {run_key}, queued "
                  "already" for run_key, count in self.joined.items()]
        held = [f"{count} verify request(s) for {table!r} joined its verification run held "
                f"back until {_utc_time(self.pacing.held[table].not_before)} UTC"
                for table, count in self.held_back.items()]
        return started + joined + held


async def fetch_requests(client: NatsClient, stream: str, durable: str,
                         recorded_through: int, limit: int) -> list[SnapshotRequest]:
    """New requests (stream sequence above ``recorded_through``), read with the durable
    consumer ``durable``; acks those a previous pass already recorded. The consumer is
    provisioning's (``cdc-platform provision``): binding to it needs no right to create
    consumers; a missing one is a ProvisioningError saying so."""
    js = client.jetstream()
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        raise ProvisioningError(
            f"the durable consumer {durable} of stream {stream} does not exist: run "
            "`cdc-platform provision` (it makes it; the sensor only reads with it)") from None
    subscription = await js.pull_subscribe_bind(durable, stream)
    messages = await fetch_available(subscription, limit, 1.0)
    fresh = []
    for message in messages:
        seq = message.metadata.sequence.stream
        if seq <= recorded_through:
            await message.ack()  # its RunRequest was recorded: done with it
            continue
        fresh.append(parse_request(message.subject, message.data, seq))
        # not acked now: redelivered after ack_wait, and acked on the tick that sees
        # the cursor past it. A crash before the cursor is saved loses nothing.
        await message.in_progress()
    return fresh
