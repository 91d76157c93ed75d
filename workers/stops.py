"""Stopping every in-flight request of a dataset, in every worker process, within a second.

A real SGLang server aborts only an exact, live rid (``/abort_request`` with a prefix does nothing, and
requests waiting in its queue would be prefilled and started before their streams' next chunk could tell
anyone). So each worker process keeps its own in-flight requests by dataset (``InflightRequests``: rid,
server, and a ``StopHandle`` on the stream), and one ``StopWatcher`` thread per process stops them:

- **How it learns.** Whoever may stop a dataset (``tokenfleet pause/revoke/budget``, and the worker whose
  chunk reached the budget) publishes the dataset's name on the ledger's stops channel
  (``Ledger.announce_stop``). The watcher listens, and asks the ledger whether the dataset must stop
  (``Ledger.stop_reasons``: revoked, paused, budget or sample cap reached): the ledger decides, a message
  only wakes it.
  Pub/sub reaches every host at once, with no per-token cost; because a message is lost while a watcher
  reconnects, the watcher also asks the ledger every ``POLL_S`` about each dataset it has in flight, which
  bounds a stop's delay even then. A request admitted before a stop may be sent just after the watcher
  looked: for ``HOT_FOR_S`` after a message the watcher looks at that dataset every ``HOT_POLL_S``.
- **A revoked task.** A Celery task revoked while it runs (Flower's Revoke button) has its own requests
  stopped the same way (``stop_owner``): the requests a thread sends while it runs a task's sample are
  tracked as that task's (``InflightRequests.owned_by``).
- **How it stops.** Each request of the dataset is aborted by its own rid on its own server (with the
  admin key when the server has one), in parallel. The server ends a running request after one more
  decode step and a waiting one at once; its stream then ends with an abort chunk carrying the exact
  partial output, which the runner records or gives back. Where the abort is not taken (an sglang-router
  answers 404) or the stream has not ended ``ABORT_GRACE_S`` later, the watcher hangs up the stream:
  closing the connection aborts the request on the server too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

import redis

from budget import Ledger, LedgerError
from workers.sglang.client import ABORT_GRACE_S, SGLangClient, StopHandle

log = logging.getLogger(__name__)

#: How often the watcher asks the ledger about the datasets it has in flight, whatever pub/sub says (a
#: message is lost only while the watcher reconnects, and it asks at once when back).
POLL_S: Final = 5.0
#: After a stop message for a dataset, its requests that start meanwhile (admitted before the stop, sent
#: after the watcher looked) are looked for this often, for ``HOT_FOR_S``.
HOT_POLL_S: Final = 0.25
HOT_FOR_S: Final = 10.0
#: Abort requests sent at once (each is one short POST). A worker process runs up to twice its servers' batch
#: sizes: with 16 at once, the real server on busy cores took 4 rounds to abort the 64 requests waiting in
#: its queue of a 32-slot batch, and some were prefilled and generated first (the revoke conformance test
#: missed its 1 s); 64 took two rounds for the 96 of that test, and a CI run found 17 of them still
#: generating after 1 s. As many as the client's connections: one round for what a process runs.
ABORT_THREADS: Final = 256
#: After losing its pub/sub connection, the watcher waits this long before reconnecting.
RECONNECT_S: Final = 1.0
#: A dataset the watcher found stopped stays so for the requests tracked after, for this long after each
#: look that found it so: one admitted before the stop and sent between two looks would otherwise reach
#: the server (a real server prefills it before its abort can land).
STOPPED_FRESH_S: Final = 1.0


@dataclass(eq=False, slots=True)
class InflightRequest:
    """One generation in flight: its dataset, and the handle that knows its current rid and server."""

    dataset: str
    handle: StopHandle
    #: When it was tracked (monotonic): a server runs its requests first come, first served.
    since: float = field(default_factory=time.monotonic)
    #: The Celery task whose sample sent it (None outside a task).
    owner: str | None = None


@dataclass(slots=True)
class Tries:
    """The requests a sample's generation sent in one thread (one per try), for its task's result."""

    owner: str
    count: int = 0


class InflightRequests:
    """This process's requests in flight, by dataset. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_dataset: dict[str, set[InflightRequest]] = {}
        self._local = threading.local()
        #: Datasets found stopped: dataset -> (reason, when last found so, monotonic).
        self._stopped: dict[str, tuple[str, float]] = {}

    def mark_stopped(self, dataset: str, reason: str) -> None:
        """``dataset`` was found stopped for ``reason`` (``""``: it runs): requests tracked in the next
        ``STOPPED_FRESH_S`` are stopped before they are sent."""
        with self._lock:
            if reason:
                self._stopped[dataset] = (reason, time.monotonic())
            else:
                self._stopped.pop(dataset, None)

    def stopped(self, dataset: str) -> str:
        """Why ``dataset`` was found stopped in the last ``STOPPED_FRESH_S``, or ``""``."""
        with self._lock:
            reason, at = self._stopped.get(dataset, ("", 0.0))
        return reason if time.monotonic() - at < STOPPED_FRESH_S else ""

    @contextmanager
    def owned_by(self, owner: str) -> Iterator[Tries]:
        """Requests this thread tracks meanwhile belong to ``owner`` (a Celery task id), and are counted."""
        tries = Tries(owner)
        previous = getattr(self._local, "tries", None)
        self._local.tries = tries
        try:
            yield tries
        finally:
            self._local.tries = previous

    @contextmanager
    def track(self, dataset: str, rid: str, server: str) -> Iterator[InflightRequest]:
        tries: Tries | None = getattr(self._local, "tries", None)
        if tries is not None:
            tries.count += 1
        request = InflightRequest(dataset, StopHandle(rid, server), owner=tries.owner if tries else None)
        reason = self.stopped(dataset)
        if reason:  # found stopped a moment ago: never sent
            request.handle.request(reason)
        with self._lock:
            self._by_dataset.setdefault(dataset, set()).add(request)
        try:
            yield request
        finally:
            with self._lock:
                mine = self._by_dataset.get(dataset)
                if mine is not None:
                    mine.discard(request)
                    if not mine:
                        del self._by_dataset[dataset]

    def datasets(self) -> list[str]:
        with self._lock:
            return sorted(self._by_dataset)

    def of(self, dataset: str) -> list[InflightRequest]:
        with self._lock:
            return list(self._by_dataset.get(dataset, ()))

    def all(self) -> list[InflightRequest]:
        with self._lock:
            return [r for requests in self._by_dataset.values() for r in requests]

    def owned(self, owner: str) -> list[InflightRequest]:
        with self._lock:
            return [r for requests in self._by_dataset.values() for r in requests if r.owner == owner]


class StopWatcher:
    """One per worker process: stops this process's requests of a dataset that must stop."""

    def __init__(
        self,
        ledger: Ledger,
        inflight: InflightRequests,
        client: SGLangClient,
        *,
        poll_s: float = POLL_S,
        grace_s: float = ABORT_GRACE_S,
    ) -> None:
        self._ledger = ledger
        self._inflight = inflight
        self._client = client
        self._poll_s = poll_s
        self._grace_s = grace_s
        self._aborts = ThreadPoolExecutor(max_workers=ABORT_THREADS, thread_name_prefix="tf-abort")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tokenfleet-stop-watcher", daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._aborts.shutdown(wait=False, cancel_futures=True)

    def stop_dataset(self, dataset: str, reason: str) -> int:
        """Abort each of this process's requests of ``dataset`` by its rid; returns how many.

        The youngest requests are aborted first (``ABORT_THREADS`` at a time): a server takes waiting
        requests into its batch first come, first served, so the requests that still wait in its queue
        are gone before an aborted running one frees a slot for them."""
        return self._abort_all(self._inflight.of(dataset), dataset, reason)

    def stop_owner(self, owner: str, reason: str) -> int:
        """Abort the requests of the Celery task ``owner`` by their rids (a revoke); returns how many."""
        return self._abort_all(self._inflight.owned(owner), f"task {owner}", reason)

    def _abort_all(self, requests: list[InflightRequest], what: str, reason: str) -> int:
        fresh = [r for r in requests if r.handle.request(reason)]
        # Not sent yet (waiting for a server slot): marked stopped, it never will be.
        sent = sorted((r for r in fresh if r.handle.server), key=lambda r: r.since, reverse=True)
        for _ in self._aborts.map(self._abort, sent):
            pass
        if fresh:
            log.info("%s: %s: aborted %d request(s) in flight here", what, reason, len(fresh))
        return len(fresh)

    def check(self, datasets: list[str]) -> None:
        """Ask the ledger about ``datasets`` and stop those that must stop."""
        if not datasets:
            return
        for dataset, reason in self._ledger.stop_reasons(datasets).items():
            stop = reason if reason != "unknown" else ""
            self._inflight.mark_stopped(dataset, stop)
            if stop:
                self.stop_dataset(dataset, stop)

    # --- the thread -----------------------------------------------------------------------------

    def _abort(self, request: InflightRequest) -> None:
        request.handle.abort_sent_at = time.monotonic()  # the grace before hanging up runs from here
        if not self._client.abort(request.handle.server, request.handle.rid):
            request.handle.hang_up()  # no abort endpoint (a router) or not allowed: closing aborts it

    def _hang_up_overdue(self) -> None:
        deadline = time.monotonic() - self._grace_s
        for request in self._inflight.all():
            sent_at = request.handle.abort_sent_at
            if sent_at and sent_at < deadline:
                request.handle.hang_up()

    def _run(self) -> None:
        pubsub = None
        next_poll = next_hot = 0.0
        #: Datasets a stop message named lately, and until when (monotonic) they are looked at often.
        hot: dict[str, float] = {}
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self._ledger.subscribe_stops()
                    next_poll = 0.0  # messages may have been missed while away
                now = time.monotonic()
                if now >= next_poll:
                    self.check(self._inflight.datasets())
                    self._hang_up_overdue()
                    next_poll = now + self._poll_s
                if hot and now >= next_hot:
                    hot = {d: until for d, until in hot.items() if until > now}
                    # every hot dataset, in flight here or not: one admitted before its stop may be sent
                    # here after, and the look keeps its stop fresh (STOPPED_FRESH_S)
                    self.check(sorted(hot))
                    self._hang_up_overdue()
                    next_hot = now + min(HOT_POLL_S, self._poll_s)
                wake = min(next_poll, next_hot) if hot else next_poll
                message = pubsub.get_message(timeout=max(0.0, wake - time.monotonic()))
                if message is not None and message.get("type") == "message":
                    dataset = message["data"]
                    dataset = dataset.decode() if isinstance(dataset, bytes) else str(dataset)
                    hot[dataset] = time.monotonic() + HOT_FOR_S
                    next_hot = time.monotonic() + HOT_POLL_S
                    self.check([dataset])
            except (LedgerError, redis.RedisError, OSError) as e:
                log.warning("stop watcher: %s; reconnecting", e)
                _close_quietly(pubsub)
                pubsub = None
                self._stop.wait(RECONNECT_S)
            except Exception:  # never let the watcher die: stops would wait for each stream's next chunk
                log.exception("stop watcher: unexpected error")
                _close_quietly(pubsub)
                pubsub = None
                self._stop.wait(RECONNECT_S)
        _close_quietly(pubsub)


def _close_quietly(pubsub: object) -> None:
    close = getattr(pubsub, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # a broken connection may fail to close: it is dropped either way
            log.debug("closing the stops subscription failed", exc_info=True)
    return None
