"""How often a server streams a chunk to us: ``stream_interval`` per request, when a dataset sets none.

Chunks no longer carry the budget (reservations do) nor stops (aborts by rid do): they show the stream is
alive, and feed status its live tokens. Each chunk costs the server and us a JSON message, and SGLang's
default chunks repeat the whole output so far (cumulative ``output_ids``), so their cost grows with the
square of the output's length over the interval. So the interval is as long as stall detection allows: a
chunk about every quarter of ``stall_timeout_s`` at the speed a stream is expected to reach, at least
``STREAM_INTERVAL_MIN`` tokens and at most the request's ``max_new_tokens``: on a fast server, a request
streams its first token and its end. (Where the ledger reads a dataset's live tokens to admit, the worker
counts its requests between chunks at the speed one stream got on the server: ``Lease.reported``.)

The expected speed must survive a server that slows down, or long-paced streams pass the stall timeout
with nothing to show, are thrown away and retried: GPU time spent for nothing, and (before this bound) a
server marked down for its own load. A server's per-stream speed falls as its batch grows, so the pacer
models this process's share of the server as a throughput (tokens/s over all of this process's streams
on it) and divides it by the streams in flight now, capped by the per-stream speed measured: a process
that ramps from 64 to 1,024 streams expects a sixteenth of the speed, before any slow answer comes back.
Both figures follow slower answers fast and faster ones slowly, and a stream that stalls sets them to
what it saw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from budget.defaults import STREAM_INTERVAL_MIN
from workers.sglang.client import ServerBusy

#: Weight of a generation faster than the estimate (the estimate rises slowly) ...
RISE: Final = 0.2
#: ... and of one slower than it (the estimate follows a slowdown within a few answers).
FALL: Final = 0.5
#: A chunk comes about every this fraction of the stall timeout at the expected speed.
STALL_SHARE: Final = 0.25


class PacedTooLong(ServerBusy):
    """A stream was silent for the stall timeout while the same server answered other streams of this
    process: the interval we asked for was too long for the server's speed, the server is not wedged.
    Retried (with a shorter interval), and not counted against the server's health."""


@dataclass
class _Server:
    speed: float  # tokens/s of one stream
    throughput: float  # tokens/s of this process's streams together
    load: int = 0  # this process's streams on the server now
    heard: float = float("-inf")  # when a chunk or an answer last came from it


@dataclass
class PacedStream:
    """One request's pacing: the interval asked for, and what the stream has shown so far."""

    interval: int
    load: int  # this process's streams on the server when it started, itself included
    started: float
    figures: _Server
    #: The tokens/s one stream got on the server, as measured when this one opened (0: not yet).
    speed: float = 0.0
    closed: bool = False


class StreamPacer:
    """One per worker process: each server's measured speed, its load from this process, and the
    interval they give."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}

    def open(self, server: str, max_new_tokens: int, stall_timeout_s: float) -> PacedStream:
        """A request to ``server`` starts: the interval it should ask for. ``close`` must follow."""
        now = self._clock()
        with self._lock:
            s = self._servers.setdefault(server, _Server(speed=0.0, throughput=0.0))
            s.load += 1
            expected = min(s.speed, s.throughput / s.load) if s.speed else None
            load = s.load
        if expected is None:  # never measured: short chunks until a first answer comes back
            interval = min(STREAM_INTERVAL_MIN, max(1, max_new_tokens))
        else:
            tokens = int(expected * stall_timeout_s * STALL_SHARE)
            interval = max(STREAM_INTERVAL_MIN, min(tokens, max_new_tokens or tokens))
        return PacedStream(interval, load, now, s, s.speed)

    def heard(self, paced: PacedStream) -> None:
        """A chunk came on ``paced``: its server is alive. No lock (one store, on every chunk of every
        stream: a lock here made a convoy of a thousand streams' threads): a racing store keeps a time a
        moment older, which only errs towards blaming the server."""
        paced.figures.heard = self._clock()

    def hearing(self, paced: PacedStream, on_tokens: Callable[[int], bool]) -> Callable[[int], bool]:
        """``on_tokens`` for ``paced``'s chunks, noting each as heard first."""

        def heard_then(n: int) -> bool:
            self.heard(paced)
            return on_tokens(n)

        return heard_then

    def finished(self, paced: PacedStream, tokens: int) -> None:
        """``paced`` ended with its answer: ``tokens`` generated since it opened (queueing and prefill
        included, so the speed errs low and the interval short)."""
        now = self._clock()
        seconds = now - paced.started
        with self._lock:
            s = paced.figures
            s.heard = now
            if tokens < 2 or seconds <= 0:
                return
            speed = tokens / seconds
            # the lower of its load at start and at end: ramping up or winding down, the throughput errs
            # low
            throughput = speed * min(paced.load, s.load)
            if not s.speed:
                s.speed, s.throughput = speed, throughput
            else:
                s.speed = _follow(s.speed, speed)
                s.throughput = _follow(s.throughput, throughput)

    def stalled(self, paced: PacedStream, tokens: int, stall_timeout_s: float) -> bool:
        """``paced`` passed the stall timeout having shown ``tokens``: the estimates drop to what it saw.
        True when the server answered another stream of this process in the last half of the silence
        (it is alive: the interval was too long). A wedged server's last answer is at least that old
        for the stream that heard it, so one of its stalls always counts against it."""
        now = self._clock()
        seconds = max(now - paced.started, 1e-3)
        with self._lock:
            s = paced.figures
            speed = max(tokens, 1) / seconds
            s.speed = min(s.speed, speed) if s.speed else speed
            throughput = speed * s.load  # itself still counted: it closes after this
            s.throughput = min(s.throughput, throughput) if s.throughput else throughput
            return now - s.heard < stall_timeout_s / 2

    def close(self, paced: PacedStream) -> None:
        """The request is over, however it ended."""
        with self._lock:
            if not paced.closed:
                paced.closed = True
                paced.figures.load -= 1


def _follow(old: float, new: float) -> float:
    return old + (FALL if new < old else RISE) * (new - old)
