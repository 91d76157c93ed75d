"""The worker's threads are scheduled as batch work (workers/scheduling.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from celery import signals

from tests.support.signals import connected
from workers import scheduling, tasks

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")

_REPORT_POLICIES = """
import os, threading
from workers.scheduling import run_as_batch
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # whatever the test runner's policy
before = os.sched_getscheduler(0)
done = run_as_batch()
seen = []
t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(threading.get_native_id())))
t.start(); t.join()
print(before, done, os.sched_getscheduler(0), seen[0])
"""


@linux_only
def test_a_thread_scheduled_as_batch_passes_it_to_the_threads_it_starts() -> None:
    # in a process of its own: the test process keeps its policy
    out = subprocess.run(
        [sys.executable, "-c", _REPORT_POLICIES], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    before, done, after, thread = int(out[0]), out[1], int(out[2]), int(out[3])
    assert before == os.SCHED_OTHER
    assert done == "True"
    assert after == os.SCHED_BATCH
    assert thread == os.SCHED_BATCH


def test_a_refused_policy_leaves_the_default_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(scheduling.os, "SCHED_BATCH", 3, raising=False)
    monkeypatch.setattr(scheduling.os, "sched_setscheduler", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger="workers.scheduling"):
        assert scheduling.run_as_batch() is False
    assert "could not schedule the worker's threads as batch work" in caplog.text
    assert "Operation not permitted" in caplog.text


def test_a_platform_without_the_policy_keeps_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(scheduling.os, "SCHED_BATCH", raising=False)
    assert scheduling.run_as_batch() is False


def test_the_worker_schedules_itself_as_batch_before_it_starts() -> None:
    assert tasks._schedule_as_batch in connected(signals.worker_init)
