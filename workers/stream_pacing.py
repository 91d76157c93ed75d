"""How often a server streams a chunk to us: ``stream_interval`` per request, when a dataset sets none.

Chunks no longer carry the budget (reservations do) nor stops (aborts by rid do): they show the stream is
alive, and feed status its live tokens. Each chunk costs the server and us a JSON message, and SGLang's
default chunks repeat the whole output so far (cumulative ``output_ids``), so their cost grows with the
square of the output's length over the interval. So the interval is as long as stall detection allows: a
chunk about every quarter of ``stall_timeout_s`` at the speed this process measured on the server (its
generations' tokens over their durations), at least ``STREAM_INTERVAL_MIN`` tokens and at most the
request's ``max_new_tokens``: on a fast server, a request streams its first token and its end.
"""

from __future__ import annotations

import threading
from typing import Final

from budget.defaults import STREAM_INTERVAL_MIN

#: Weight of the newest generation in a server's measured speed.
SMOOTHING: Final = 0.2


class StreamPacer:
    """One per worker process: each server's measured tokens/s per stream, and the interval it gives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._speed: dict[str, float] = {}

    def interval(self, server: str, max_new_tokens: int, stall_timeout_s: float) -> int:
        with self._lock:
            speed = self._speed.get(server)
        if speed is None:
            return min(STREAM_INTERVAL_MIN, max(1, max_new_tokens))
        tokens = int(speed * stall_timeout_s / 4)
        return max(STREAM_INTERVAL_MIN, min(tokens, max_new_tokens))

    def observe(self, server: str, tokens: int, seconds: float) -> None:
        """A generation on ``server`` produced ``tokens`` in ``seconds`` (queueing and prefill included,
        so the speed errs low and the interval short)."""
        if tokens < 2 or seconds <= 0:
            return
        speed = tokens / seconds
        with self._lock:
            old = self._speed.get(server)
            self._speed[server] = speed if old is None else old + SMOOTHING * (speed - old)
