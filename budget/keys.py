"""Every Redis key the ledger uses, and nothing else builds one.

Per-dataset keys carry the dataset name in a hash tag (``{name}``) so one dataset's keys live in one
Redis Cluster slot and a Lua script may touch them all. The suffix says the Redis type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: Prefix of every tokenfleet key; the Celery broker's own keys (the queue list, ``unacked``) sit beside.
PREFIX: Final = "tf"

#: Set of every registered dataset name.
DATASETS_SET: Final = f"{PREFIX}:datasets:set"

#: Pub/sub channel: a message (the dataset's name) each time a dataset may have to stop its in-flight
#: generations (revoked, paused, its budget reached or lowered). Every worker process listens and aborts
#: its own requests of that dataset by their rids (``workers/stops.py``).
STOPS_CHANNEL: Final = f"{PREFIX}:stops:channel"

#: Hash worker name -> JSON heartbeat (version, code fingerprint, concurrency, last seen), for status.
WORKERS_HASH: Final = f"{PREFIX}:workers:hash"


@dataclass(frozen=True, slots=True)
class DatasetKeys:
    """The keys of one dataset."""

    #: Hash: state, limits, counters (the fields are listed in ``budget/lua/_lib.lua``).
    ledger_hash: str
    #: String: JSON of what workers need (servers, sampling, output dir, timeouts).
    spec_str: str
    #: Hash sample id -> attempt id of the committed generation (the done-set).
    done_hash: str
    #: Hash sample id -> failure reason.
    failed_hash: str
    #: Sorted set sample id -> enqueue time (ms): tasks published and not yet taken by a worker.
    queued_zset: str
    #: Sorted set sample id -> lease expiry (ms): generations in flight.
    lease_zset: str
    #: Hash sample id -> attempt id holding the lease.
    lease_owner_hash: str
    #: Hash sample id -> tokens generated so far by the in-flight attempt (not yet committed), as its
    #: worker last reported them (every few seconds; status only).
    live_hash: str
    #: Hash sample id -> tokens of the token budget reserved for the in-flight attempt: the most it may
    #: generate (``budget/lua/_lib.lua``, Reservations).
    reserved_hash: str
    #: Hash sample id -> its clock (ms, Redis's clock): when a generation granted at send time under a
    #: truncate budget would have started at the dataset's speed, to tell what its grant has used
    #: (``budget/lua/_lib.lua``, Reservations).
    clock_hash: str
    #: Hash sample id -> why it went back to pending (dropped while paused, revoked, at a limit, a lease
    #: that expired, released): taken out of the queue without a result, to be fed again.
    pending_hash: str
    #: Hash sample id -> how many attempts gave up on it after exhausting their retries.
    strikes_hash: str
    #: Hash epoch second -> tokens generated in that second (as workers report them, and the rest at
    #: commit).
    rate_tokens_hash: str
    #: Hash epoch second -> samples committed in that second.
    rate_samples_hash: str
    #: Hash length bucket -> committed samples whose completion tokens fall in it: tokens per sample as a
    #: fixed log-scale histogram (the buckets and the percentiles read from them: ``budget/lengths.py``).
    lengths_hash: str
    #: Hash: what ties the dataset to its outputs and first submit (fields in ``budget/ledger.py``,
    #: ``IDENTITY_FIELDS``): the epoch and storage tokens of the output folder's markers, the fingerprint of
    #: its generation settings, the current version's name.
    identity_hash: str
    #: String: the source's fingerprint at its first submit (compact: see ``tokenfleet/fingerprint.py``).
    source_digest_str: str
    #: Hash sample id -> the record (JSON) of a generation whose record could not be written (a full
    #: disk): held here, its lease kept without expiry, until a worker writes and commits it
    #: (``budget/lua/hold.lua``); the ledger's ``held`` and ``held_bytes`` count them.
    held_hash: str
    #: String with an expiry: the worker process writing the held records now (one at a time).
    held_flush_str: str

    def for_lua(self, *names: str) -> list[str]:
        """The named keys, in order, for a script's KEYS."""
        return [getattr(self, n) for n in names]


def dataset_keys(name: str) -> DatasetKeys:
    base = f"{PREFIX}:{{{name}}}"
    return DatasetKeys(
        ledger_hash=f"{base}:ledger:hash",
        spec_str=f"{base}:spec:str",
        done_hash=f"{base}:done:hash",
        failed_hash=f"{base}:failed:hash",
        queued_zset=f"{base}:queued:zset",
        lease_zset=f"{base}:lease:zset",
        lease_owner_hash=f"{base}:lease_owner:hash",
        live_hash=f"{base}:live:hash",
        reserved_hash=f"{base}:reserved:hash",
        clock_hash=f"{base}:clock:hash",
        pending_hash=f"{base}:pending:hash",
        strikes_hash=f"{base}:strikes:hash",
        rate_tokens_hash=f"{base}:rate_tokens:hash",
        rate_samples_hash=f"{base}:rate_samples:hash",
        lengths_hash=f"{base}:lengths:hash",
        identity_hash=f"{base}:identity:hash",
        source_digest_str=f"{base}:source_digest:str",
        held_hash=f"{base}:held:hash",
        held_flush_str=f"{base}:held_flush:str",
    )


# --- servers (issue 7: many servers) ------------------------------------------------------------------

#: Every server key shares the hash tag ``{servers}``: the one script that picks the least-loaded server
#: and takes its slot must see all the servers' keys, and Redis Cluster wants them in one slot.
SERVERS_TAG: Final = f"{PREFIX}:{{servers}}"

#: Sorted set server URL -> last time (ms) a worker picked among it: the servers ``status`` lists.
SERVERS_SEEN_ZSET: Final = f"{SERVERS_TAG}:seen:zset"


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The keys of one server (an SGLang server or a router), fleet-wide."""

    #: Sorted set slot token -> lease expiry (ms): the generations in flight on this server, from every
    #: worker process. An expired member is a slot whose holder died; the next pick drops it.
    slots_zset: str
    #: Hash: health and counters (fields listed in ``budget/lua/server_report.lua``).
    health_hash: str
    #: Hash: a ring of per-second counts of finished requests (fields in ``budget/lua/server_release.lua``).
    rate_hash: str
    #: String with an expiry: while it exists, nobody probes the server's ``/health`` (one probe per
    #: interval, fleet-wide).
    probe_str: str


def server_keys(url: str) -> ServerKeys:
    base = f"{SERVERS_TAG}:server:{url}"
    return ServerKeys(
        slots_zset=f"{base}:slots:zset",
        health_hash=f"{base}:health:hash",
        rate_hash=f"{base}:rate:hash",
        probe_str=f"{base}:probe:str",
    )
