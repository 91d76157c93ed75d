"""Choosing a server for each generation, fleet-wide.

Each generation takes a slot on the server with the fewest generations in flight across the whole fleet
(every worker process on every host), among those below their cap (``max_inflight_per_server``, by default
the server's ``max_running_requests``): one atomic pick in Redis (``budget/lua/server_acquire.lua``). A slot
is a lease, renewed here while its generation runs, so a killed worker's slots expire. When every server
is at its cap the generation waits, asking again with a bounded backoff (at once when a thread of this
process gives a slot back).

Health. The runner tells the picker at once of a generation that failed on the server's side (transport
error, 5xx, dropped stream, an abort we did not ask for: ``failed``), so a dead server is marked down
within milliseconds, before more generations are sent there and fail too; the retry then ``avoid``s it. A
generation ended without such a call was answered (told only where it changes something: a server down
or failing, at the thread's next generation, ordered by when it ended). ``DEFAULT_FAIL_THRESHOLD``
failures in a row mark a server down: no generation goes there while another server is up (when none is,
the down ones are still tried: a single server is never given up on, though one found dead is waited
for, below). Every worker's picker probes the down servers' ``/health``, one probe per server and interval
fleet-wide, and marks a server up again when it answers 200.

Dead servers. A server marked down that refused this process's connections (``unreachable``: nothing
listens at its port, as while SGLang restarts) is dead here: while every server of a pick is, a generation
waits for a probe to mark one up (``wait_reachable``) instead of sending requests that can only be refused,
and its sample goes back to pending after a bounded wait.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

import httpx
import redis

from budget import LedgerError
from budget.server_board import Acquired, Health, ServerLedger, ServerOutcome
from workers.batching import CallBatcher
from workers.sglang.client import ServerBusy, ServerStalled
from workers.sglang.protocol import HEALTH_PATH
from workers.sglang.wire import tls_context

log = logging.getLogger(__name__)

#: Failures in a row that mark a server down.
DEFAULT_FAIL_THRESHOLD: Final = 3
#: A down server is probed (``GET /health``) this often, by one worker of the fleet.
DEFAULT_PROBE_INTERVAL_S: Final = 5.0
#: How long a probe waits. SGLang's ``/health`` runs a one-token generation: a second or more on a busy
#: server, and it answers 503 itself after about 20 s; a shorter wait would keep a busy, healthy server
#: down.
PROBE_TIMEOUT_S: Final = 30.0
#: When every server is at its cap, the process's waiting generations are asked for again together (one
#: script call for all of them, by the picks thread) as soon as this process gives a slot back, and at
#: least this often for slots given back elsewhere.
WAIT_MAX_S: Final = 0.25
#: ... and, while asking again finds no free slot, at least this often.
WAIT_IDLE_MAX_S: Final = 1.0
#: ... but this soon after asking found free slots: other processes are giving theirs back (they ran out
#: of waiting generations, as at a dataset's end), and each slot free in Redis is a server slot idle. At
#: WAIT_MAX_S such slots stayed free for half of 0.25 s (a median 0.14 s against 0.03 now, in
#: tests/redis/test_servers_picker.py). Only asks that find slots come this often.
WAIT_GRANTED_S: Final = 0.05
#: Waiting generations offered per script call at most (the rest wait for the next round).
PICKS_PER_CALL: Final = 64
#: The picks thread looks this often whether the dataset of a waiting generation was stopped meanwhile.
CANCEL_CHECK_S: Final = 0.5
#: The picker's background thread renews slots every quarter lease, and looks for due probes this often
#: while a server it knows is down or failing.
TICK_MAX_S: Final = 1.0
#: Seconds between counts of handed-over slots in the servers' figures (status only; at once when the
#: process has nothing in flight), and between looks for probes due while no server this process knows
#: was down or failing at its last pick (a server found down at a pick is looked at every tick).
FLUSH_EVERY_S: Final = 5.0
#: A worker stops probing a server it has not picked among for this long (the config moved on).
FORGET_AFTER_S: Final = 3600.0

#: Errors of a connection that could not be made (besides a refusal and an unknown host): the request
#: never reached the server.
UNREACHABLE_ERRNOS: Final = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})

#: Probes a down server: (whether it is back, what was seen).
Prober = Callable[[str], tuple[bool, str]]

#: ``caps`` of ``use``: one cap for every server, or one per server URL (None or absent: no cap).
Caps = Mapping[str, int | None] | int | None

#: What picks share one script call: the servers, their caps, and the server to avoid.
PickKey = tuple[tuple[str, ...], tuple[int | None, ...], str | None]


@dataclass(eq=False, slots=True)
class _Waiter:
    """A generation waiting for a slot."""

    key: PickKey
    token: str
    cancelled: Callable[[], bool] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    url: str | None = None
    error: BaseException | None = None


class SlotWaitCancelled(Exception):
    """The generation was stopped while it waited for a server slot: it never reached a server."""


def unreachable(failure: BaseException) -> bool:
    """Whether ``failure`` is a connection that could not be made (refused, no route to the host, an
    unknown host): the request never reached a server, so it says nothing about what was asked. The client
    raises its errors ``from None``; the socket's error is still their context."""
    cause = failure.__context__
    if isinstance(cause, ConnectionRefusedError | socket.gaierror):
        return True
    return isinstance(cause, OSError) and cause.errno in UNREACHABLE_ERRNOS


def caps_for(servers: Sequence[str], caps: Caps) -> list[int | None]:
    """The cap of each of ``servers``."""
    if caps is None or isinstance(caps, int):
        return [caps] * len(servers)
    return [caps.get(url) for url in servers]


class ServerPicker:
    """One per worker process, shared by its threads."""

    def __init__(
        self,
        client: redis.Redis,
        lease_ms: int,
        *,
        fail_threshold: int = DEFAULT_FAIL_THRESHOLD,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        prober: Prober | None = None,
    ) -> None:
        self.board = ServerLedger(client)
        self._lease_ms = lease_ms
        self._fail_threshold = fail_threshold
        self._probe_interval_ms = int(probe_interval_s * 1000)
        self._holder = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._held: dict[str, str] = {}  # slot token -> server
        self._known: dict[str, float] = {}  # server -> when this process last picked among it (monotonic)
        self._dirty: set[str] = set()  # down, or failing in a row, at the last pick
        self._probing: set[str] = set()
        # Marked down after refusing this process's connections, and not seen up since (``wait_reachable``)
        self._dead: set[str] = set()
        self._dead_changed = threading.Condition(self._lock)
        self._local = threading.local()  # .pending: (server, ended_ms) of this thread's last generation
        # Redis's clock minus this host's (ms), as last seen: ends of generations that make no Redis call
        # (a slot handed over) are told in Redis time, the clock their outcome reports are ordered by.
        self._clock_offset_ms: float | None = None
        # Generations waiting for a slot, in the order they asked; the picks thread serves them.
        self._waiting: list[_Waiter] = []
        self._wake = threading.Event()  # set when a generation asks, or this process gives a slot back
        self._handed: dict[str, int] = {}  # server -> slots handed over since the last flush
        self._picks_thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=max(probe_interval_s, PROBE_TIMEOUT_S), verify=tls_context())
        self._prober: Prober = prober or self._health_probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # This process's threads' releases that come together share one script call.
        self._releases: CallBatcher[str, str, int] = CallBatcher("slot-releases", self._release_batch)

    def held(self) -> int:
        """The server slots this process holds now (its generations running, and those handed one)."""
        return len(self._held)

    def wait_reachable(
        self, servers: Sequence[str], timeout_s: float, cancelled: Callable[[], bool] | None = None
    ) -> bool:
        """Wait while every one of ``servers`` is dead here (marked down after refusing this process's
        connections): a generation sent there now would only be refused. True at once when one is not, or
        once a probe or another worker's generation marks one up; False after ``timeout_s``.
        ``cancelled``: raise ``SlotWaitCancelled`` once it says so (the dataset was stopped meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while servers and self._dead.issuperset(servers):
                if cancelled is not None and cancelled():
                    raise SlotWaitCancelled()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._dead_changed.wait(min(left, CANCEL_CHECK_S))
        return True

    @contextmanager
    def use(
        self,
        servers: Sequence[str],
        avoid: str | None = None,
        caps: Caps = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[str]:
        """Hold a slot on the least-loaded of ``servers`` (below its cap; waits while all are at theirs).

        ``avoid``: the server this sample's previous attempt failed on, used only when no other server is
        a candidate. ``caps``: see ``Caps``. ``cancelled``: while waiting for a slot, raise
        ``SlotWaitCancelled`` once it says so (the dataset was stopped meanwhile).
        """
        self._settle_previous()
        self._local.failed_on = None
        token = f"{self._holder}:{uuid.uuid4().hex[:16]}"
        server, token = self._acquire(list(servers), caps_for(servers, caps), token, avoid, cancelled)
        answered = False
        try:
            yield server
            answered = True  # an exception out of the block tells nothing about the server
        finally:
            # When it ended, in Redis time: a success reported later (at this thread's next use) must not
            # pass for one after failures that came between, nor mark up a server that died since.
            ended_ms = self._redis_now_ms()
            failed = getattr(self._local, "failed_on", None) == server
            # a failed generation's slot is not handed over: the waiting one would likely fail there too
            if not (answered and not failed and self._hand_over(server, token)):
                with self._lock:
                    self._held.pop(token, None)
                    # the process's last slot: the handed-over ones are counted now, before this
                    # generation's commit can settle the run (status then shows every request)
                    last = self._idle_with_uncounted()
                try:
                    ended_ms = self._releases.call(server, token)
                    if last:
                        self._flush_handed()
                except LedgerError as e:  # the slot expires on its own
                    log.warning("could not give back a slot on %s: %s", server, e)
                self._wake.set()  # a waiting generation may take the slot
            self._local.pending = (server, ended_ms) if answered and not failed else None

    def _hand_over(self, server: str, token: str) -> bool:
        """Pass the slot of a generation that ended to the oldest generation of this process waiting for
        one on that server: no Redis call (the slot stays taken, fleet-wide); it counts as a request
        finished and one started at the next flush. Not for a server that is down or failing."""
        with self._lock:
            if server in self._dirty:
                return False
            for w in self._waiting:
                servers, _caps, avoid = w.key
                if server in servers and (server != avoid or len(servers) == 1):
                    self._waiting.remove(w)
                    w.token, w.url = token, server
                    self._held[token] = server
                    self._handed[server] = self._handed.get(server, 0) + 1
                    w.done.set()
                    return True
        return False

    def _redis_now_ms(self) -> int:
        """Redis's clock now, from this host's and the offset last seen (one ``TIME`` the first time)."""
        if self._clock_offset_ms is None:
            try:
                self._note_redis_time(self.board.now_ms())
            except LedgerError:
                return int(time.time() * 1000)
        return int(time.time() * 1000 + (self._clock_offset_ms or 0.0))

    def _note_redis_time(self, redis_ms: int) -> None:
        self._clock_offset_ms = redis_ms - time.time() * 1000

    def _idle_with_uncounted(self) -> bool:
        """Whether nothing runs or waits here and handed-over slots are still to be counted (their counts
        then go out at once: status shows every request). The caller holds the lock."""
        return not self._held and not self._waiting and bool(self._handed)

    def _flush_handed(self) -> None:
        """Count the slots handed over since the last flush in their servers' figures (one call each)."""
        with self._lock:
            handed, self._handed = self._handed, {}
        for server, n in handed.items():
            try:
                self.board.release_many(server, [], handed_over=n)
            except LedgerError as e:  # the counts are for status only
                log.warning("could not count %d requests on %s: %s", n, server, e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http.close()

    # --- picking --------------------------------------------------------------------------------

    def _acquire(
        self,
        servers: list[str],
        caps: list[int | None],
        token: str,
        avoid: str | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[str, str]:
        """A slot and its token (``token``, or that of a slot handed over by ``_hand_over``). Asked for
        by the picks thread with every other generation of this process that waits, in one script call
        (``budget/lua/server_acquire.lua``): while every server is at its cap the wait costs Redis one
        call per round for the whole process, not one per generation."""
        self._start()
        waiter = _Waiter((tuple(servers), tuple(caps), avoid), token, cancelled)
        with self._lock:
            self._known.update(dict.fromkeys(servers, time.monotonic()))
            self._waiting.append(waiter)
        self._wake.set()
        # No timeout: the picks thread looks for cancelled waits (a thousand waiting threads that woke
        # twice a second to look themselves kept the GIL busy for nothing)
        waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.url is not None
        return waiter.url, waiter.token

    def _serve_waiting(self) -> None:
        """The picks thread: offer the waiting generations, oldest first, to the servers; wait for a slot
        given back here (or ``WAIT_MAX_S``, for one given back elsewhere) while some still wait."""
        wait_s = WAIT_MAX_S
        next_pick = next_cancel_check = time.monotonic()
        while not self._stop.is_set():
            picked = False  # whether a pick of this round found a free slot
            woken = self._wake.wait(max(0.0, min(next_pick, next_cancel_check) - time.monotonic()))
            self._wake.clear()
            now = time.monotonic()
            if now >= next_cancel_check:
                next_cancel_check = now + CANCEL_CHECK_S
                self._end_cancelled_waits()
            if not woken and now < next_pick:
                continue
            with self._lock:
                by_key: dict[PickKey, list[_Waiter]] = {}
                for w in self._waiting:
                    by_key.setdefault(w.key, []).append(w)
            for key, waiters in by_key.items():
                offered = waiters[:PICKS_PER_CALL]
                tokens = [w.token for w in offered]
                try:
                    got = self._pick_batch(key, tokens)
                except Exception as e:  # every generation offered sees the error, as if it had asked alone
                    with self._lock:
                        for w in offered:
                            if w in self._waiting:
                                self._waiting.remove(w)
                                w.error = e
                                w.done.set()
                    continue
                stray: list[tuple[str, str]] = []
                with self._lock:
                    self._dirty.difference_update(key[0])
                    for a in got[:1]:
                        self._dirty.update(a.dirty)
                    for w, token, a in zip(offered, tokens, got, strict=True):
                        if a.url is None:
                            continue
                        picked = True
                        if w not in self._waiting or w.token != token:
                            # cancelled, or handed a slot by an ended generation meanwhile: this slot is
                            # not needed, give it back now (unrenewed, it would hold its place a lease)
                            stray.append((a.url, token))
                            continue
                        self._held[token] = a.url
                        w.url = a.url
                        self._waiting.remove(w)
                        w.done.set()
                for url, token in stray:
                    with contextlib.suppress(LedgerError):
                        self.board.release_unused(url, token)
                if len(waiters) > PICKS_PER_CALL and all(a.url is not None for a in got):
                    self._wake.set()  # every one offered got a slot: offer the next ones at once
            # Waiting for slots given back elsewhere (this process hands its own over): ask less often
            # while asking finds none, up to WAIT_IDLE_MAX_S; a local release or a new ask resets it.
            granted = any(w.done.is_set() for ws in by_key.values() for w in ws)
            if picked:
                wait_s = WAIT_GRANTED_S
            elif woken or granted:
                wait_s = WAIT_MAX_S
            else:
                wait_s = min(WAIT_IDLE_MAX_S, wait_s * 2)
            next_pick = time.monotonic() + wait_s

    def _end_cancelled_waits(self) -> None:
        """Waits whose generation was stopped meanwhile end with ``SlotWaitCancelled``."""
        with self._lock:
            for w in [w for w in self._waiting if w.cancelled is not None and w.cancelled()]:
                self._waiting.remove(w)
                w.error = SlotWaitCancelled()
                w.done.set()

    # --- health ---------------------------------------------------------------------------------

    def _release_batch(self, server: str, tokens: Sequence[str]) -> list[int]:
        ended_ms = self.board.release_many(server, tokens)
        self._note_redis_time(ended_ms)
        return [ended_ms] * len(tokens)

    def _pick_batch(self, key: PickKey, tokens: Sequence[str]) -> list[Acquired]:
        servers, caps, avoid = key
        return self.board.acquire_many(
            servers, caps, tokens, self._lease_ms, avoid=avoid, first=random.randrange(len(servers))
        )

    def failed(self, server: str, failure: BaseException) -> None:
        """This thread's generation on ``server`` (in the ``use`` block, or the one that just ended) failed
        on the server's side: its health hears it now. A ``ServerBusy`` (the server shed the request, or
        our stream interval was too long for its speed) says nothing against the server."""
        if isinstance(failure, ServerBusy):
            return
        self._local.failed_on = server
        self._local.pending = None
        with self._lock:
            self._dirty.add(server)  # no slot of it is handed over until a pick says it is well
        # A stalled server (silent past the stall timeout) is suspect at once: a wedged engine would
        # otherwise take a slot per generation for minutes, three times over.
        threshold = 1 if isinstance(failure, ServerStalled) else None
        health = self._report(server, ServerOutcome.FAIL, self._redis_now_ms(), str(failure), threshold)
        if health is not None and not health.up and unreachable(failure):
            with self._lock:
                self._dead.add(server)
        elif health is not None:  # it answered, or is not down: worth a try
            self._mark_alive(server)

    def _settle_previous(self) -> None:
        """Report that this thread's previous generation was answered, where that changes something."""
        pending: tuple[str, int] | None = getattr(self._local, "pending", None)
        self._local.pending = None
        if pending is not None:
            with self._lock:
                # A success changes something only where failures were counted or the server is down.
                worth_it = pending[0] in self._dirty
            if worth_it:
                self._report(pending[0], ServerOutcome.OK, pending[1])

    def _report(
        self,
        server: str,
        outcome: ServerOutcome,
        at_ms: int = 0,
        message: str = "",
        fail_threshold: int | None = None,
    ) -> Health | None:
        """Tell the server's health (None when Redis could not be told); one seen up is not dead here."""
        try:
            health = self.board.report(
                server,
                outcome,
                at_ms=at_ms,
                fail_threshold=fail_threshold or self._fail_threshold,
                probe_interval_ms=self._probe_interval_ms,
                message=message,
            )
        except LedgerError as e:
            log.warning("could not report %s on %s: %s", outcome.value, server, e)
            return None
        if health.up:
            self._mark_alive(server)
        if health.changed and not health.up:
            log.warning("server %s marked down after %d failures in a row: %s", server, health.fails, message)
        elif health.changed:
            log.warning("server %s is up again (%s)", server, outcome.value)
        return health

    def _mark_alive(self, server: str) -> None:
        """``server`` is not dead here any more: the generations waiting for it go."""
        with self._lock:
            if server in self._dead:
                self._dead.discard(server)
                self._dead_changed.notify_all()

    def _refresh_dead(self) -> None:
        """The dead servers that were marked up (by a probe or a generation of another worker) are not
        dead here any more: one script call, each tick while some server is dead here."""
        with self._lock:
            dead = sorted(self._dead)
        if dead:
            for status in self.board.status(dead):
                if status.up:
                    self._mark_alive(status.url)

    def _health_probe(self, server: str) -> tuple[bool, str]:
        try:
            reply = self._http.get(server + HEALTH_PATH)
            return reply.status_code == 200, f"GET {HEALTH_PATH}: HTTP {reply.status_code}"
        except httpx.HTTPError as e:
            return False, f"GET {HEALTH_PATH}: {type(e).__name__}: {e}"

    def _probe(self, server: str) -> None:
        try:
            try:
                ok, message = self._prober(server)
            except Exception as e:  # a probe that breaks says the server is not back
                ok, message = False, f"probe: {type(e).__name__}: {e}"
            self._report(server, ServerOutcome.PROBE_OK if ok else ServerOutcome.PROBE_FAIL, 0, message)
        finally:
            with self._lock:
                self._probing.discard(server)

    # --- the background thread ------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="tokenfleet-server-slots", daemon=True)
            self._picks_thread = threading.Thread(
                target=self._serve_waiting, name="tokenfleet-slot-picks", daemon=True
            )
        self._thread.start()
        self._picks_thread.start()

    def _run(self) -> None:
        # Slots are renewed every quarter lease, not every tick: a renewal costs Redis commands per slot,
        # and a generation lasts many ticks. Probes are looked at every tick while a server is down.
        renew_every_s = self._lease_ms / 4000
        tick_s = min(renew_every_s, TICK_MAX_S)
        next_renew = time.monotonic() + renew_every_s
        next_flush = 0.0
        while not self._stop.wait(tick_s):
            try:
                now = time.monotonic()
                if now >= next_renew:
                    next_renew = now + renew_every_s
                    self._renew()
                with self._lock:
                    idle = self._idle_with_uncounted()
                if now >= next_flush or idle:
                    next_flush = now + FLUSH_EVERY_S
                    self._flush_handed()
                    self._start_probes()
                elif self._dirty:
                    self._start_probes()
                self._refresh_dead()
            except LedgerError as e:  # Redis away for a moment: try again next tick
                log.warning("server slots: %s", e)
            except Exception:  # never let the renewals die: the slots would expire under running work
                log.exception("server slots: unexpected error")

    def _renew(self) -> None:
        with self._lock:
            held = [(server, token) for token, server in self._held.items()]
        renewed = self.board.renew(held, self._lease_ms)
        with self._lock:
            # A slot given back since the snapshot is not renewed, and not lost either.
            lost = [
                server
                for (server, token), ok in zip(held, renewed, strict=True)
                if not ok and token in self._held
            ]
        for server in lost:
            log.warning("a slot on %s expired while its generation ran (not renewed for a lease)", server)

    def _start_probes(self) -> None:
        stale = time.monotonic() - FORGET_AFTER_S
        with self._lock:
            self._known = {url: t for url, t in self._known.items() if t > stale}
            known = sorted(self._known)
        if not known:
            return
        for server in self.board.probes_due(known, self._probe_interval_ms):
            with self._lock:
                if server in self._probing:
                    continue
                self._probing.add(server)
            threading.Thread(target=self._probe, args=(server,), name="tokenfleet-probe", daemon=True).start()
