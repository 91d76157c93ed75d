"""Keeps this process's generation leases alive while their streams are silent (queued at the server,
long prefill). A killed process stops renewing, so its leases expire and the ledger reclaims the samples.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from budget import Ledger, LedgerError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    dataset: str
    sample_id: str
    attempt: str
    #: Set when a renewal found the lease taken back: the generation must stop.
    lost: threading.Event = field(default_factory=threading.Event)


class LeaseKeeper:
    def __init__(self, ledger: Ledger, lease_ms: int) -> None:
        self._ledger = ledger
        self._lease_ms = lease_ms
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

    @property
    def count(self) -> int:
        """Generations this process holds a lease for (its in-flight work)."""
        with self._lock:
            return len(self._leases)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval_s = self._lease_ms / 4000
        while not self._stop.wait(interval_s):
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    if not self._ledger.renew(lease.dataset, lease.sample_id, lease.attempt, self._lease_ms):
                        lease.lost.set()
                except LedgerError as e:  # Redis away for a moment: try again next round
                    log.warning("lease renewal failed: %s", e)
