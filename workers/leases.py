"""Keeps this process's generation leases alive, and tells the ledger how many tokens each generation has
produced so far (for status and rates: budgets are kept by reservations, not by these reports).

One ledger call per dataset every ``REPORT_S`` covers all of the process's leases of it, whatever their
number and however many chunks their streams brought: the ledger's cost does not grow with the tokens. A
killed process stops renewing, so its leases expire and the ledger reclaims the samples.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Final

from budget import Ledger, LedgerError

log = logging.getLogger(__name__)

#: Seconds between two reports of a process's leases (renewal and live tokens).
REPORT_S: Final = 5.0
#: ... while a dataset asks for its live tokens sooner (``Renewal.soon``: a discard budget's first answers).
REPORT_SOON_S: Final = 1.0


@dataclass(slots=True)
class Lease:
    dataset: str
    sample_id: str
    attempt: str
    #: Set when a renewal found the lease taken back: the generation must stop.
    lost: threading.Event = field(default_factory=threading.Event)
    #: Tokens its generation has produced so far (this attempt, kept replies included).
    live: int = 0
    #: Where the ledger admits from the live tokens (``Renewal.soon``): (since, tokens/s, base, most) of
    #: the request running now, counted at that speed between its chunks (``reported``).
    pace: tuple[float, float, int, int] | None = None

    def reported(self, now: float) -> int:
        """The live tokens to report: those counted from the stream's chunks, or, where the request is
        paced (``pace``), what it has produced at its expected speed if that is more: ``base`` (the
        tokens counted when it was sent) and at most ``most`` (its ``max_new_tokens``) past them. A
        stream paced for the stall timeout sends a chunk every quarter of it (15 s of tokens by default),
        longer than most answers: counted from its chunks alone, a discard budget's running answers
        showed the ledger only their first tokens, and the short answers that ended first became the
        measure of every answer."""
        if self.pace is None:
            return self.live
        since, speed, base, most = self.pace
        return max(self.live, base + min(most, int(speed * max(0.0, now - since))))


class LeaseKeeper:
    def __init__(self, ledger: Ledger, lease_ms: int, report_s: float = REPORT_S) -> None:
        self._ledger = ledger
        self._lease_ms = lease_ms
        self._interval_s = min(report_s, lease_ms / 4000)
        #: The datasets that asked at the last report for the next one within ``REPORT_SOON_S``.
        self._soon: set[str] = set()
        #: The datasets the last report covered: a lease of another one is reported at the next tick (the
        #: ledger learns whether that dataset wants its live tokens soon).
        self._reported: set[str] = set()
        self._leases: dict[tuple[str, str, str], Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, dataset: str, sample_id: str, attempt: str) -> Lease:
        lease = Lease(dataset, sample_id, attempt)
        with self._lock:
            self._leases[(dataset, sample_id, attempt)] = lease
        return lease

    def drop(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop((lease.dataset, lease.sample_id, lease.attempt), None)

    def live_wanted(self, dataset: str) -> bool:
        """Whether ``dataset``'s live tokens are read soon: it asked for them at the last report, or no
        report has covered it yet (its first generations, before the ledger could say)."""
        with self._lock:
            return dataset in self._soon or dataset not in self._reported

    @property
    def count(self) -> int:
        """Generations this process holds a lease for (its in-flight work)."""
        with self._lock:
            return len(self._leases)

    def stop(self) -> None:
        self._stop.set()

    def report(self) -> None:
        """Renew every lease and report its live tokens: one ledger call per dataset."""
        by_dataset: dict[str, list[Lease]] = {}
        soon: set[str] = set()
        now = time.monotonic()
        with self._lock:
            for lease in self._leases.values():
                by_dataset.setdefault(lease.dataset, []).append(lease)
        for dataset, leases in by_dataset.items():
            try:
                renewal = self._ledger.renew_report(
                    dataset, [(x.sample_id, x.attempt, x.reported(now)) for x in leases], self._lease_ms
                )
            except LedgerError as e:  # Redis away for a moment: try again next round
                log.warning("lease renewal failed: %s", e)
                continue
            if renewal.soon:
                soon.add(dataset)
            for lease, ok in zip(leases, renewal.held, strict=True):
                if not ok:
                    lease.lost.set()
        with self._lock:
            self._soon = soon
            self._reported = set(by_dataset)

    def _new_dataset(self) -> bool:
        """Whether a lease is held of a dataset the last report did not cover."""
        with self._lock:
            return any(lease.dataset not in self._reported for lease in self._leases.values())

    def _run(self) -> None:
        # Ticks of at most REPORT_SOON_S; a report every interval, or at each tick while a dataset asked
        # for its live tokens soon (at once after the report that asked, not after the interval).
        tick = min(self._interval_s, REPORT_SOON_S)
        last = time.monotonic()
        while not self._stop.wait(tick):
            due = bool(self._soon) or time.monotonic() - last >= self._interval_s - tick / 2
            if not due and not self._new_dataset():
                continue
            last = time.monotonic()
            try:
                self.report()
            except Exception:  # never let renewals die: the leases would expire under running work
                log.exception("lease keeper: unexpected error")
