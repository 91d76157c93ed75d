"""The worker process's garbage collector, set for thousands of threads that each hold a generation.

A worker process runs a thread per sample in flight (a thousand and more) and allocates a few objects per
chunk, answer and ledger call. With CPython's default thresholds (a young collection every 700 net
allocations) it collected all the time, and every so often a full collection walked the whole heap: the
modules, Celery and the app make up most of it and never die. A collection holds the GIL, so every thread
of the process waits: at a truncate budget's end, where a thousand answers end within half a second and
what is given back must reach the next requests at once, full collections took 0.08-0.15 s of CPU each
(0.3-0.4 s wall) in both worker processes, in the middle of it.

So once the worker is ready its objects so far are frozen (``gc.freeze``: kept out of every collection,
as they live as long as the process), and young collections come every ``YOUNG`` net allocations instead
of 700. Garbage without cycles is freed at once, as always (reference counting); only cycles wait for a
collection.
"""

from __future__ import annotations

import gc
from typing import Final

#: Net allocations of container objects between two young collections (CPython's default: 700).
YOUNG: Final = 50_000
#: Young collections between two of the middle generation (CPython's default: 10), and middle ones between
#: two full ones (CPython's default, kept: cycles that lived long enough to reach the oldest generation
#: are freed as often as before, relative to the allocations; a full collection also waits until a
#: quarter of that generation is new). Cheap now: the frozen objects are not walked.
MIDDLE: Final = 20
FULL: Final = 10


def settle_collector() -> None:
    """Collect once, freeze what is left (the process's long-lived objects), and collect less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, FULL)
