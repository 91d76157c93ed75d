"""The worker process's garbage collector (workers/collector.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from celery import signals

from tests.support.signals import connected
from workers import tasks
from workers.collector import FULL, MIDDLE, YOUNG, settle_collector


@pytest.fixture
def collector_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settling_freezes_the_objects_so_far_and_collects_less_often(collector_restored: None) -> None:
    settle_collector()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (YOUNG, MIDDLE, FULL)


def test_cycles_made_after_settling_are_still_collected(collector_restored: None) -> None:
    settle_collector()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None  # a cycle: reference counting alone does not free it
    gc.collect()
    assert gone() is None


def test_the_worker_settles_its_collector_once_ready() -> None:
    assert tasks._settle_collector in connected(signals.worker_ready)
