"""The worker process's threads are scheduled as batch work (Linux ``SCHED_BATCH``), not as interactive.

A worker process runs a thread per generation in flight (a thousand and more), and the threads wake each
other all the time: a batched ledger call's thread wakes each of its callers, a finished generation hands its
server slot to a waiting one. Under Linux's default policy a thread woken from a sleep may preempt the
thread running on its core, which here is often the thread that woke it, still holding the GIL: the woken
thread finds the GIL taken and waits, and the whole process waits with it until the waker gets a core again
(what the profile below suggests; docs/budgets.md measures the change's effect, not this mechanism).
At a truncate budget's end, where about a thousand answers end, are continued or are turned away within a
second on two cores shared with the server, a profile of the worker processes put 40% of the samples taken
while a thread held the GIL in the batchers waking their callers.

``SCHED_BATCH`` tells the kernel that the threads are CPU-bound work that is not interactive: a woken thread
no longer preempts the running one, it runs at the next scheduling tick or when a core is free
(sched(7): "for workloads that want a deterministic scheduling policy without interactivity causing extra
preemptions (between the workload's tasks)"). The same policy also keeps the workers' wake-ups from
preempting an inference server that shares their host. Nice values and fair shares are unchanged, and an
unprivileged process may choose it for itself. Threads inherit the policy of the thread that creates them,
so it is set in the main thread before the worker starts its pools (``worker_init``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def run_as_batch() -> bool:
    """Schedule the calling thread, and the threads and processes it starts after, as ``SCHED_BATCH``.
    Returns whether it is now so; False where the platform has no such policy (not Linux) or refuses it."""
    batch = getattr(os, "SCHED_BATCH", None)
    setter = getattr(os, "sched_setscheduler", None)
    if batch is None or setter is None:
        return False
    try:
        setter(0, batch, os.sched_param(0))
    except OSError as e:  # a sandbox that forbids it: the default policy, as before
        log.warning("could not schedule the worker's threads as batch work: %s", e)
        return False
    return True
