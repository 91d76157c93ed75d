"""A real worker process runs every thread as batch work (workers/scheduling.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_every_thread_of_a_running_worker_is_scheduled_as_batch_work(
    workers: list[subprocess.Popen[bytes]],
) -> None:
    for proc in workers:
        policies = {}
        for tid in (int(t) for t in os.listdir(f"/proc/{proc.pid}/task")):
            try:
                policies[tid] = os.sched_getscheduler(tid)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
        assert len(policies) > 1  # the worker's pools and batchers run
        assert set(policies.values()) == {os.SCHED_BATCH}, policies
