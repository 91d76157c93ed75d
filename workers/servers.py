"""Choosing a server for each generation: the one with the fewest requests in flight from this process."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class ServerPicker:
    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tiebreak = itertools.count()

    @contextmanager
    def use(self, servers: Sequence[str], avoid: str | None = None) -> Iterator[str]:
        """Hold a slot on the least-loaded of ``servers`` (``avoid`` only when it is the only one)."""
        candidates = [s for s in servers if s != avoid] or list(servers)
        with self._lock:
            turn = next(self._tiebreak)
            n = len(candidates)
            server = min(
                (candidates[(turn + i) % n] for i in range(n)), key=lambda s: self._inflight.get(s, 0)
            )
            self._inflight[server] = self._inflight.get(server, 0) + 1
        try:
            yield server
        finally:
            with self._lock:
                self._inflight[server] -= 1
