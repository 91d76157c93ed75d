"""The fleet-wide view of the servers: slots in flight, health, request rate. Every change is one Lua script
(``budget/lua/server_*.lua``); every key comes from ``budget.keys``.

A slot is a lease on one generation's place at a server: taken when the generation starts (the least-loaded
server below its cap, in one atomic step), renewed while it streams, given back when it ends. A worker
that dies stops renewing, so its slots expire and the next pick drops them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis

from budget.keys import SERVERS_SEEN_ZSET, server_keys
from budget.ledger import _translate_errors, connect
from budget.scripts import register_scripts, server_script_keys

#: Finished requests are counted per second over this many seconds for the request rate.
RATE_WINDOW_S: Final = 10

#: A server no worker picked among for this long drops out of the status list.
SEEN_TTL_MS: Final = 24 * 3600 * 1000


class ServerOutcome(enum.StrEnum):
    """What a report says about a server (see ``budget/lua/server_report.lua``)."""

    OK = "ok"
    FAIL = "fail"
    PROBE_OK = "probe_ok"
    PROBE_FAIL = "probe_fail"


@dataclass(frozen=True, slots=True)
class Acquired:
    """The answer of one pick."""

    #: The server the slot is on, or None when every candidate is at its cap (wait and ask again).
    url: str | None
    #: Slots on ``url`` now, this one included.
    inflight: int
    #: Servers of the pick that are down or have failures in a row.
    dirty: frozenset[str]


@dataclass(frozen=True, slots=True)
class Health:
    """A server's health after a report."""

    up: bool
    #: This report marked the server up or down.
    changed: bool
    #: Failures in a row.
    fails: int


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """One server as ``tokenfleet status`` shows it."""

    url: str
    #: Generations in flight on it, fleet-wide (unexpired slots).
    inflight: int
    #: The cap the latest pick used (None: no cap).
    cap: int | None
    up: bool
    #: Requests finished per second, over the last ``RATE_WINDOW_S`` seconds.
    requests_per_s: float
    #: Generations started on it, in total.
    started: int
    #: Failures reported, in total, and in a row now.
    failures: int
    fails_in_a_row: int
    #: Times it was marked down.
    downs: int
    #: While it is down: since when (Redis time, ms).
    down_since_ms: int | None
    last_error: str
    #: Seconds since it last answered a generation or a probe (None: never): "up" is only what the workers
    #: last found, and with no worker using it that may be long ago.
    last_ok_s_ago: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _int(fields: Mapping[str, str], name: str) -> int:
    return int(fields.get(name) or 0)


class ServerLedger:
    """Typed wrappers around the server scripts. Thread-safe (redis-py clients are)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = register_scripts(client)

    @classmethod
    def from_url(cls, url: str, *, patient: bool = False) -> ServerLedger:
        return cls(connect(url, patient=patient))

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        return self._scripts[name](keys=list(keys), args=list(args))

    # --- workers --------------------------------------------------------------------------------

    @_translate_errors
    def acquire_many(
        self,
        servers: Sequence[str],
        caps: Sequence[int | None],
        tokens: Sequence[str],
        lease_ms: int,
        *,
        avoid: str | None = None,
        first: int = 0,
    ) -> list[Acquired]:
        """Take a slot for each of ``tokens``, each on the least-loaded of ``servers`` that is up and below
        its cap at its turn (``caps[i]`` for ``servers[i]``, None for none); ``avoid`` only when nothing
        else is a candidate. Ties go to the first from index ``first`` on. One script call."""
        keys = [SERVERS_SEEN_ZSET]
        args: list[Any] = [
            " ".join(tokens),
            lease_ms,
            avoid or "",
            first % max(len(servers), 1) + 1,
            SEEN_TTL_MS,
        ]
        for url, cap in zip(servers, caps, strict=True):
            k = server_keys(url)
            keys += [k.slots_zset, k.health_hash]
            args += [url, cap or 0]
        urls, inflight, dirty = self._run("server_acquire", keys, args)
        dirty_set = frozenset(dirty.split())
        picked = urls.split()
        return [
            Acquired(None if url == "-" else url, int(inflight) if i == len(picked) - 1 else 0, dirty_set)
            for i, url in enumerate(picked)
        ]

    def acquire(
        self,
        servers: Sequence[str],
        caps: Sequence[int | None],
        token: str,
        lease_ms: int,
        *,
        avoid: str | None = None,
        first: int = 0,
    ) -> Acquired:
        """``acquire_many`` for one slot."""
        return self.acquire_many(servers, caps, [token], lease_ms, avoid=avoid, first=first)[0]

    @_translate_errors
    def release_many(
        self, url: str, tokens: Sequence[str], handed_over: int = 0, unused: Sequence[str] = ()
    ) -> int:
        """Give back the slots ``tokens`` on ``url`` and count the finished requests, with ``handed_over``
        slots a worker passed from an ended generation straight to a waiting one (each a request finished
        and one started), and the slots ``unused``, taken but never used (their start is taken back);
        returns the Redis time (ms) of the release, which orders these generations' outcome reports. One
        script call."""
        k = server_keys(url)
        keys = server_script_keys("server_release", k)
        args = [RATE_WINDOW_S, handed_over, len(unused), *unused, *tokens]
        _held, now_ms = self._run("server_release", keys, args)
        return int(now_ms)

    def release(self, url: str, token: str) -> int:
        """``release_many`` for one slot."""
        return self.release_many(url, [token])

    def release_unused(self, url: str, token: str) -> None:
        """Give back a slot taken but never used: no request counts as started or finished on it."""
        self.release_many(url, [], unused=[token])

    @_translate_errors
    def now_ms(self) -> int:
        """Redis's clock (ms): the clock outcome reports are ordered by."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    @_translate_errors
    def renew(self, slots: Sequence[tuple[str, str]], lease_ms: int) -> list[bool]:
        """Renew each ``(url, token)`` slot; False for a slot that was dropped (it expired)."""
        if not slots:
            return []
        keys = [server_keys(url).slots_zset for url, _ in slots]
        renewed = self._run("server_renew", keys, [lease_ms, *(token for _, token in slots)])
        return [bool(r) for r in renewed]

    @_translate_errors
    def report(
        self,
        url: str,
        outcome: ServerOutcome,
        *,
        at_ms: int = 0,
        fail_threshold: int,
        probe_interval_ms: int,
        message: str = "",
    ) -> Health:
        """Record a generation's or a probe's outcome; ``fail_threshold`` failures in a row (ordered by
        ``at_ms``, the end of each generation) mark the server down."""
        k = server_keys(url)
        state, changed, fails = self._run(
            "server_report",
            server_script_keys("server_report", k),
            [outcome.value, at_ms, fail_threshold, probe_interval_ms, message[:500]],
        )
        return Health(state == "up", bool(changed), int(fails))

    @_translate_errors
    def probes_due(self, servers: Sequence[str], probe_interval_ms: int) -> list[str]:
        """The down servers this caller should probe now (each claimed for one interval, fleet-wide)."""
        keys: list[str] = []
        for url in servers:
            k = server_keys(url)
            keys += [k.health_hash, k.probe_str]
        return [str(u) for u in self._run("server_probe", keys, [probe_interval_ms, *servers])]

    # --- reading --------------------------------------------------------------------------------

    @_translate_errors
    def known(self) -> list[str]:
        """Servers some worker picked among in the last day, sorted."""
        return sorted(str(u) for u in self.client.zrange(SERVERS_SEEN_ZSET, 0, -1))

    @_translate_errors
    def status(self, servers: Sequence[str] | None = None) -> list[ServerStatus]:
        """Each server's in-flight count, rate and health (``servers``: the known ones by default)."""
        urls = list(servers) if servers is not None else self.known()
        if not urls:
            return []
        keys: list[str] = []
        for url in urls:
            k = server_keys(url)
            keys += [k.slots_zset, k.health_hash, k.rate_hash]
        out = []
        for url, inflight, finished, flat, now_ms in self._run("server_status", keys, [RATE_WINDOW_S, *urls]):
            f = dict(zip(flat[::2], flat[1::2], strict=True))
            up = f.get("state", "up") == "up"
            last_ok = _int(f, "last_ok_ms")
            out.append(
                ServerStatus(
                    url=str(url),
                    inflight=int(inflight),
                    cap=_int(f, "cap") or None,
                    up=up,
                    requests_per_s=int(finished) / RATE_WINDOW_S,
                    started=_int(f, "started"),
                    failures=_int(f, "failures"),
                    fails_in_a_row=_int(f, "fails"),
                    downs=_int(f, "downs"),
                    down_since_ms=None if up else _int(f, "down_since_ms"),
                    last_error=f.get("last_error", ""),
                    last_ok_s_ago=max(0.0, (int(now_ms) - last_ok) / 1000) if last_ok else None,
                )
            )
        return out

    @_translate_errors
    def forget(self, url: str) -> None:
        """Delete every key of server ``url`` (its slots, health and rate)."""
        k = server_keys(url)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(k.slots_zset, k.health_hash, k.rate_hash, k.probe_str)
        pipe.zrem(SERVERS_SEEN_ZSET, url)
        pipe.execute()
